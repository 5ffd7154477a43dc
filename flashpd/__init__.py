"""flashpd: disaggregated prefill/decode serving with exact DFlash speculative decoding."""
from flashpd.engine.sampling import SamplingParams
from flashpd.llm import LLM, RequestOutput

__all__ = ["LLM", "SamplingParams", "RequestOutput"]
__version__ = "0.1.0"
