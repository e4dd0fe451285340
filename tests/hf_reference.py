"""transformers as the reference serving tests compare with (imported by test modules; pytest
puts this folder on sys.path)."""
import torch


def load(model_dir) -> "torch.nn.Module":
    """The checkpoint as transformers' LlamaForCausalLM, float32, eval mode."""
    from transformers import LlamaForCausalLM
    return LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def greedy(model, ids, n) -> list[int]:
    """transformers' greedy continuation of ids, n tokens, never stopping at EOS."""
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False)
    return out[0, len(ids):].tolist()
