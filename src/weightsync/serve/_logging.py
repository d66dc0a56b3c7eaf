"""What `weightsync serve` logs: Python's records at `--log-level`, torch's C++ warnings below debug.

torch's C++ side (c10d's store and gloo) writes its own warnings straight to stderr, each with
dozens of C++ frames: a trainer that closes its group is one such warning. For a server that is
an expected event, which weightsync logs itself in one line; torch's warning and its frames are
detail, shown only at `--log-level debug`. `TORCH_CPP_LOG_LEVEL`, when set, is the user's
choice and stays as it is.
"""

from __future__ import annotations

import ctypes
import logging
import os
from pathlib import Path

import torch

logger = logging.getLogger("weightsync.serve")

TORCH_CPP_LOG_LEVEL_ENV = "TORCH_CPP_LOG_LEVEL"
# c10's levels (glog's): 0 INFO, 1 WARNING, 2 ERROR, 3 FATAL.
_CPP_ERROR = 2


def configure_logging(level: str) -> None:
    """Logs Python's records at `level` (`debug` .. `error`) and quiets torch's C++ below debug."""
    logging.basicConfig(level=level.upper(), format="%(levelname)s %(name)s: %(message)s")
    if level != "debug" and TORCH_CPP_LOG_LEVEL_ENV not in os.environ:
        _set_torch_cpp_log_level(_CPP_ERROR)


def _set_torch_cpp_log_level(level: int) -> None:
    """Sets c10's log level in this process, torch already imported.

    c10 reads `TORCH_CPP_LOG_LEVEL` once, when torch is loaded, into the flag below, and reads
    the flag at each message; the server's options are parsed after torch is loaded.
    """
    library = Path(torch.__file__).parent / "lib" / "libc10.so"
    try:
        flag = ctypes.c_int.in_dll(ctypes.CDLL(str(library)), "FLAGS_caffe2_log_level")
    except (OSError, ValueError):  # another build (a glog one): its C++ warnings stay
        logger.debug("cannot set torch's C++ log level (no %s flag): set %s=ERROR to quiet it",
                     library, TORCH_CPP_LOG_LEVEL_ENV)  # fmt: skip
        return
    flag.value = level
