"""Write a tiny random Llama-architecture model with the real SmolLM2 tokenizer, as safetensors.

Tests load it through the production loader, so no test mocks the model.
"""

from pathlib import Path

from django.core.management.base import BaseCommand


class Command(BaseCommand):
    help = "Write a tiny random Llama model (real SmolLM2 tokenizer) to DIR as safetensors."

    def add_arguments(self, parser):
        parser.add_argument("directory")
        parser.add_argument("--layers", type=int, default=2)
        parser.add_argument("--hidden", type=int, default=64)
        parser.add_argument("--context", type=int, default=1024)
        parser.add_argument("--seed", type=int, default=0)

    def handle(self, directory, layers, hidden, context, seed, **options):
        import torch
        from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

        from inference_app.catalogue import default_model_path

        target = Path(directory)
        target.mkdir(parents=True, exist_ok=True)
        gguf = default_model_path()
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        config = LlamaConfig(
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
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
        model.save_pretrained(target)
        tokenizer.save_pretrained(target)
        self.stdout.write(f"wrote a {layers}-layer, {hidden}-wide random Llama model to {target}")
