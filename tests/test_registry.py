"""The lazily built torchlib registry dispatches exactly like torch's own from_torchlib."""

from torch.onnx._internal.exporter import _registration

from ort_dynamo.export import _lazy_torchlib_registry


def test_lazy_registry_has_the_same_functions_and_signatures_as_from_torchlib():
    lazy = _lazy_torchlib_registry(18)
    full = _registration.ONNXRegistry.from_torchlib(18)
    assert lazy.functions.keys() == full.functions.keys()
    for key, decomps in full.functions.items():
        assert [d.onnx_function for d in lazy.functions[key]] == [d.onnx_function for d in decomps], key
    for key, decomps in list(full.functions.items())[::5]:
        target = decomps[0].fx_target
        assert lazy.is_registered(target) == full.is_registered(target)
        assert [str(d.signature) for d in lazy.get_decomps(target)] == \
            [str(d.signature) for d in full.get_decomps(target)], key
