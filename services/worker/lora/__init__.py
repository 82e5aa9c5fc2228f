"""LoRA adapters over the base model: PEFT adapters read and checked (adapter.py), held in the
slot table the scheduler assigns (slots.py), applied per token by slot in the decoder's linear
layers (apply.py), loaded on demand with a host cache (manager.py)."""
