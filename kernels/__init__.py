"""tierattn.kernels: Triton kernels for paged KV attention, each with a plain-torch reference.

Every public op takes ``backend="auto" | "triton" | "torch"``: Triton on CUDA tensors or under
the interpreter (``TRITON_INTERPRET=1``), the torch reference otherwise. Shapes, the page-table
contract and the math are in ``kernels/README.md``. No transformers import here.
"""

if __name__ == "kernels":
    # Python started in the checkout has its root on sys.path, where this folder (installed as
    # tierattn.kernels) is found as `kernels` first. That name belongs to Hugging Face's kernels
    # package, which transformers imports when it is installed: hand the name over to the
    # `kernels` found on the rest of the path (or to none), as if this folder were not there.
    import importlib.machinery as _machinery
    import importlib.util as _util
    import os as _os
    import sys as _sys

    _root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
    _spec = _machinery.PathFinder.find_spec(
        "kernels", [p for p in _sys.path if _os.path.abspath(p or _os.curdir) != _root])
    if _spec is None or _spec.loader is None:
        raise ModuleNotFoundError("No module named 'kernels'", name="kernels")
    _module = _util.module_from_spec(_spec)
    _sys.modules["kernels"] = _module  # what `import kernels` returns once this file has run
    _spec.loader.exec_module(_module)
    # the rest of this file still runs, into the discarded module: it imports tierattn.kernels
    # under its own name, which Hugging Face's kernels does not touch

from tierattn.kernels.page_copy import copy_pages, copy_pages_reference
from tierattn.kernels.decode import (
    DecodeOutput,
    decode_page_mass,
    merge_page_mass,
    merge_page_mass_reference,
    sparse_decode,
    sparse_decode_reference,
)
from tierattn.kernels.host import host_decode, host_decode_available, host_read, host_threads
from tierattn.kernels.merge import merge_state, merge_states, merge_states_reference
from tierattn.kernels.metadata import page_metadata, page_metadata_reference
from tierattn.kernels.page_table import PageTable
from tierattn.kernels.kernel_set import KernelSet
from tierattn.kernels.prefill import (
    PrefillOutput,
    paged_prefill,
    paged_prefill_mass,
    paged_prefill_reference,
)
from tierattn.kernels.score import quest_score, quest_score_reference
from tierattn.kernels.select import PageSelection, select_pages, select_pages_reference
from tierattn.kernels.sketch import quantize_keys, sketch_score, sketch_score_reference

__all__ = [
    "DecodeOutput",
    "KernelSet",
    "PageSelection",
    "PageTable",
    "PrefillOutput",
    "copy_pages",
    "copy_pages_reference",
    "decode_page_mass",
    "host_decode",
    "host_decode_available",
    "host_read",
    "host_threads",
    "merge_page_mass",
    "merge_page_mass_reference",
    "merge_state",
    "merge_states",
    "merge_states_reference",
    "page_metadata",
    "page_metadata_reference",
    "paged_prefill",
    "paged_prefill_mass",
    "paged_prefill_reference",
    "quantize_keys",
    "quest_score",
    "quest_score_reference",
    "select_pages",
    "select_pages_reference",
    "sketch_score",
    "sketch_score_reference",
    "sparse_decode",
    "sparse_decode_reference",
]
