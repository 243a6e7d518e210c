"""Public ops: argument checks, tuned configs, keyword kernel launches and autograd (one module per op).
No ``@triton.jit`` code here; kernels are imported inside the calls, so importing this package loads no
Triton."""
from ._launch import forced_mask_path, mask_path_name
from .attention import sparse_attention
from .backward import ColumnWork, column_work
from .config import BwdConfig, DecodeConfig, FwdConfig
from .decode import DECODE_MAX_SPLITS, decode_programs_per_sm, decode_splits, sparse_decode
from .routed import routed_attention
from .._checks import SUPPORTED_DTYPES, SUPPORTED_HEAD_DIMS

__all__ = ["sparse_attention", "sparse_decode", "FwdConfig", "BwdConfig", "DecodeConfig", "column_work",
           "ColumnWork", "decode_splits", "decode_programs_per_sm", "DECODE_MAX_SPLITS", "mask_path_name",
           "forced_mask_path",
           "SUPPORTED_HEAD_DIMS", "SUPPORTED_DTYPES", "routed_attention"]
