"""Our Llama-family decoder and its loader."""
from prefix_service.model.llama import LlamaForCausalLM, ModelArch
from prefix_service.model.loader import SUPPORTED_ARCHITECTURES, load_model, load_tokenizer, read_arch

__all__ = ["LlamaForCausalLM", "ModelArch", "SUPPORTED_ARCHITECTURES", "load_model", "load_tokenizer", "read_arch"]
