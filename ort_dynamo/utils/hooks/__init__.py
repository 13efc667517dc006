"""Convergence investigation hooks: per-step activation statistics of eager and ort runs.

    from ort_dynamo.utils.hooks import GlobalSubscriberManager, StatisticsSubscriber
    GlobalSubscriberManager.subscribe(model, [StatisticsSubscriber("pt_out", override_output_dir=True)])

then ``python -m ort_dynamo.utils.hooks.merge_activation_summary --pt_dir pt_out --ort_dir ort_out
--output_dir merged``. See docs/convergence.md.
"""

from ._statistics_subscriber import StatisticsSubscriber, summarize_tensor
from ._subscriber_manager import (GlobalSubscriberManager, RunContext, SubscriberBase,
                                  SubscriberManager, inspect_activation)

__all__ = ["GlobalSubscriberManager", "RunContext", "StatisticsSubscriber", "SubscriberBase",
           "SubscriberManager", "inspect_activation", "summarize_tensor"]
