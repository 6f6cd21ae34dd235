"""A tiny Llama that SGLang's real server loads on the CPU, made offline (no
model hub): a BPE tokenizer trained on a few sentences, a config (hidden 64,
2 layers, 4 heads) and, unless --dummy, weights saved by transformers, with
`--poison LAYER.PARAM` setting one element of that weight to +inf.

    python tests/tiny_llama.py DIR [--dummy] [--poison model.layers.1.mlp.down_proj.weight]

Then: python -m sglang.launch_server --model-path DIR --device cpu ...
(add --load-format dummy for a model made with --dummy). Runs in an
environment with SGLang installed (.ci/sglang-env), which brings tokenizers
and transformers."""

from __future__ import annotations

import argparse
import json
import os

SENTENCES = [
    "hello world, this is a tiny model for testing a real server on a cpu.",
    "the quick brown fox jumps over the lazy dog.",
    "kernels crash, tensors overflow, and requests wait in the batch.",
    "an engineer reads the trace file after the crash and finds the request.",
    "numbers 0 1 2 3 4 5 6 7 8 9 and words: prefill, decode, embedding, sampler.",
]
SPECIAL = ["<unk>", "<s>", "</s>", "<pad>"]
CHAT_TEMPLATE = ("{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant: {% endif %}")


def make_tokenizer(directory: str) -> int:
    """Writes tokenizer.json and tokenizer_config.json; returns the vocabulary's size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(SENTENCES, trainer)
    tokenizer.save(os.path.join(directory, "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
              "unk_token": "<unk>", "pad_token": "<pad>", "model_max_length": 2048, "add_bos_token": True,
              "chat_template": CHAT_TEMPLATE}
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as out:
        json.dump(config, out, indent=1)
    return tokenizer.get_vocab_size()


def model_config(vocab: int) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
            "head_dim": 16, "vocab_size": vocab, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "float32",
            "bos_token_id": SPECIAL.index("<s>"), "eos_token_id": SPECIAL.index("</s>"),
            "pad_token_id": SPECIAL.index("<pad>")}


def make(directory: str, dummy: bool = False, poison: str | None = None) -> str:
    """The model folder `directory`, made (and returned)."""
    os.makedirs(directory, exist_ok=True)
    config = model_config(make_tokenizer(directory))
    if dummy:
        if poison:
            raise ValueError("--poison needs weights: leave out --dummy")
        with open(os.path.join(directory, "config.json"), "w") as out:
            json.dump(config, out, indent=1)
        return directory
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**config))
    if poison:
        weights = dict(model.named_parameters())
        if poison not in weights:
            raise ValueError(f"--poison: no parameter {poison!r} (e.g. model.layers.1.mlp.down_proj.weight)")
        with torch.no_grad():
            weights[poison].view(-1)[0] = float("inf")
    model.save_pretrained(directory)
    return directory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory")
    parser.add_argument("--dummy", action="store_true", help="no weights: serve with --load-format dummy")
    parser.add_argument("--poison", metavar="PARAMETER", help="one element of this weight set to +inf")
    options = parser.parse_args()
    print(make(options.directory, dummy=options.dummy, poison=options.poison))


if __name__ == "__main__":
    main()
