"""Write a tiny random model with the real SmolLM2 tokenizer, as safetensors: a Llama by default,
or another architecture transformers' GGUF loader reads (`--arch`, issue 44).

Tests load it through the production loader, so no test mocks the model.
"""

from pathlib import Path

from django.core.management.base import BaseCommand

# The architectures a tiny random model can be made of, each with what its config needs beyond
# the common sizes. A sliding window of 8 tokens is shorter than the tests' prompts, so the
# window is exercised, not only configured.
ARCHITECTURES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 8}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"pad_token_id": None}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"head_dim": 16, "sliding_window": 8}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"head_dim": 16, "sliding_window": 8,
                                                          "layer_types": ["sliding_attention", "full_attention"]}),
}


class Command(BaseCommand):
    help = "Write a tiny random model (real SmolLM2 tokenizer) to DIR as safetensors."

    def add_arguments(self, parser):
        parser.add_argument("directory")
        parser.add_argument("--arch", choices=sorted(ARCHITECTURES), default="llama")
        parser.add_argument("--layers", type=int, default=2)
        parser.add_argument("--hidden", type=int, default=64)
        parser.add_argument("--context", type=int, default=1024)
        parser.add_argument("--seed", type=int, default=0)

    def handle(self, directory, arch, layers, hidden, context, seed, **options):
        import torch
        import transformers
        from transformers import AutoTokenizer

        from inference_app.catalogue import default_model_path

        target = Path(directory)
        target.mkdir(parents=True, exist_ok=True)
        gguf = default_model_path()
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        config_name, model_name, extra = ARCHITECTURES[arch]
        fields = dict(
            vocab_size=len(tokenizer),
            hidden_size=hidden,
            intermediate_size=hidden * 2,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=context,
            tie_word_embeddings=True,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        fields.update(extra)
        config = getattr(transformers, config_name)(**fields)
        torch.manual_seed(seed)
        model = getattr(transformers, model_name)(config)
        model.save_pretrained(target)
        tokenizer.save_pretrained(target)
        self.stdout.write(f"wrote a {layers}-layer, {hidden}-wide random {arch} model to {target}")
