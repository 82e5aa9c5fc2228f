"""The PEFT adapter checks the gateway and the worker share, and the adapter's key in the
prefix-cache block hashes."""

import json
from pathlib import Path

import pytest

from services.common.block_hash import adapter_key, block_hashes
from services.common.lora_adapter_config import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    AdapterConfigError,
    check_adapter_config,
    read_adapter_config,
)

PLAIN = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"], "bias": "none",
         "use_dora": False, "rank_pattern": {}, "alpha_pattern": {}, "modules_to_save": None, "lora_bias": False}


def _adapter(tmp_path: Path, config: dict | str, weights: bool = True) -> Path:
    (tmp_path / CONFIG_FILE).write_text(config if isinstance(config, str) else json.dumps(config))
    if weights:
        (tmp_path / WEIGHTS_FILE).write_bytes(b"")
    return tmp_path


def test_a_plain_peft_lora_is_read_with_its_scaling(tmp_path: Path) -> None:
    config = read_adapter_config(_adapter(tmp_path, PLAIN), max_lora_rank=16)
    assert (config.rank, config.scaling, config.target_modules) == (8, 2.0, ("q_proj", "v_proj"))
    assert check_adapter_config({**PLAIN, "use_rslora": True}, 16).scaling == pytest.approx(16 / 8 ** 0.5)


@pytest.mark.parametrize("change, field", [
    ({"r": 32}, "above --max-lora-rank"), ({"r": 0}, "r must"), ({"r": True}, "r must"),
    ({"target_modules": ["lm_head"]}, "target_modules"), ({"target_modules": []}, "target_modules"),
    ({"bias": "all"}, "bias"), ({"use_dora": True}, "use_dora"), ({"rank_pattern": {"q_proj": 4}}, "rank_pattern"),
    ({"peft_type": "IA3"}, "peft_type"), ({"lora_alpha": -1}, "lora_alpha"), ({"lora_bias": True}, "lora_bias"),
])
def test_what_the_engine_would_run_differently_is_refused_naming_the_field(change: dict, field: str) -> None:
    with pytest.raises(AdapterConfigError, match=field):
        check_adapter_config({**PLAIN, **change}, max_lora_rank=16)


def test_missing_files_and_broken_json_are_refused(tmp_path: Path) -> None:
    with pytest.raises(AdapterConfigError, match="not a directory"):
        read_adapter_config(tmp_path / "absent", 16)
    with pytest.raises(AdapterConfigError, match=WEIGHTS_FILE):
        read_adapter_config(_adapter(tmp_path, PLAIN, weights=False), 16)
    with pytest.raises(AdapterConfigError, match="not JSON"):
        read_adapter_config(_adapter(tmp_path, "{r: 8"), 16)


def test_the_adapter_keys_the_block_hashes_apart_from_base_salt_and_other_adapters() -> None:
    tokens = list(range(64))
    base, a, b = (block_hashes(tokens, 16, lora_key=key) for key in (None, adapter_key("a", 1), adapter_key("b", 2)))
    a_again = block_hashes(tokens, 16, lora_key=adapter_key("a", 3))  # the name, other weights
    assert len({base[0], a[0], b[0], a_again[0]}) == 4 and len({base[-1], a[-1], b[-1], a_again[-1]}) == 4
    for salt in ("\x00lora:a", "\u00fea", "\xfea"):  # no salt can pose as an adapter
        assert block_hashes(tokens, 16, cache_salt=salt) != a
    assert block_hashes(tokens, 16, "s", adapter_key("a", 1)) == block_hashes(tokens, 16, "s", adapter_key("a", 1))
