"""pdserve: disaggregated prefill/decode LLM serving.

The offline API::

    from pdserve import LLM, SamplingParams
    llm = LLM("path/to/hf-checkpoint")
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0.0))
"""

from pdserve.engine.sampling_params import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # LLM pulls in models and torch; import it only when asked for.
    if name in ("LLM", "RequestOutput"):
        from pdserve.engine import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'pdserve' has no attribute {name!r}")
