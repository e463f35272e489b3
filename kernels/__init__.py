"""tierattn.kernels: Triton kernels for paged KV attention, each with a plain-torch reference.

Every public op takes ``backend="auto" | "triton" | "torch"``: Triton on CUDA tensors or under
the interpreter (``TRITON_INTERPRET=1``), the torch reference otherwise. Shapes, the page-table
contract and the math are in ``kernels/README.md``. No transformers import here, and nothing
imported until a name is used (PEP 562).
"""

from __future__ import annotations

#: public name -> the module that defines it
_LAZY = {
    "copy_pages": "tierattn.kernels.page_copy",
    "copy_pages_reference": "tierattn.kernels.page_copy",
    "DecodeOutput": "tierattn.kernels.decode",
    "decode_page_mass": "tierattn.kernels.decode",
    "merge_page_mass": "tierattn.kernels.decode",
    "merge_page_mass_reference": "tierattn.kernels.decode",
    "sparse_decode": "tierattn.kernels.decode",
    "sparse_decode_reference": "tierattn.kernels.decode",
    "host_decode": "tierattn.kernels.host",
    "host_decode_available": "tierattn.kernels.host",
    "host_read": "tierattn.kernels.host",
    "host_threads": "tierattn.kernels.host",
    "merge_state": "tierattn.kernels.merge",
    "merge_states": "tierattn.kernels.merge",
    "merge_states_reference": "tierattn.kernels.merge",
    "page_metadata": "tierattn.kernels.metadata",
    "page_metadata_reference": "tierattn.kernels.metadata",
    "PageTable": "tierattn.kernels.page_table",
    "KernelSet": "tierattn.kernels.kernel_set",
    "PrefillOutput": "tierattn.kernels.prefill",
    "paged_prefill": "tierattn.kernels.prefill",
    "paged_prefill_mass": "tierattn.kernels.prefill",
    "paged_prefill_reference": "tierattn.kernels.prefill",
    "quest_score": "tierattn.kernels.score",
    "quest_score_reference": "tierattn.kernels.score",
    "PageSelection": "tierattn.kernels.select",
    "select_pages": "tierattn.kernels.select",
    "select_pages_reference": "tierattn.kernels.select",
    "quantize_keys": "tierattn.kernels.sketch",
    "sketch_score": "tierattn.kernels.sketch",
    "sketch_score_reference": "tierattn.kernels.sketch",
}
__all__ = sorted(_LAZY)


def _hand_over_the_name() -> None:
    """Python started in the checkout has its root on sys.path, where this folder (installed as
    ``tierattn.kernels``) is found as ``kernels``. That name belongs to Hugging Face's kernels
    package, which transformers imports when it is installed: give ``import kernels`` the
    ``kernels`` found on the rest of the path, or -- when there is none -- what a plain folder of
    that name would be, an empty namespace package (no ``__file__``, nothing in it)."""
    import importlib.machinery
    import importlib.util
    import os
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.machinery.PathFinder.find_spec(
        "kernels", [p for p in sys.path if os.path.abspath(p or os.curdir) != root])
    if spec is None or spec.loader is None:
        for name in ("__file__", "__cached__"):
            globals().pop(name, None)
        globals()["__path__"] = []
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["kernels"] = module  # what `import kernels` returns once this file has run
    spec.loader.exec_module(module)


if __name__ == "kernels":
    _hand_over_the_name()
else:
    def __getattr__(name: str):
        if name in _LAZY:
            import importlib

            value = getattr(importlib.import_module(_LAZY[name]), name)
            globals()[name] = value
            return value
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
