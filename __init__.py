"""pdserve: disaggregated prefill/decode LLM serving.

The offline API::

    from pdserve import LLM, SamplingParams
    llm = LLM("path/to/hf-checkpoint")
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0.0))
"""

from pdserve.import_path import install as _keep_source_root_off_path

# First, before any other import: the source root on sys.path would let our folders shadow
# third-party packages of the same name (pdserve.import_path says how and why).
_keep_source_root_off_path()

from pdserve.worker_api.sampling_params import SamplingParams  # noqa: E402

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in ("LLM", "RequestOutput"):
        # lazy: LLM pulls in models and torch; `import pdserve` stays light until asked for it
        from pdserve.engine import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'pdserve' has no attribute {name!r}")
