"""Lets tests import the doc generator from tools/."""

import importlib.util
import os

_spec = importlib.util.spec_from_file_location(
    "gen_options_doc", os.path.join(os.path.dirname(__file__), "..", "tools", "gen_options_doc.py"))
_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_module)
render_options_doc = _module.render_options_doc
