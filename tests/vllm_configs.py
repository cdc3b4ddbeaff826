"""vLLM 0.33 configs for QuillConnector, built as vLLM builds them, from a config.json written here
(nothing from a hub): tests/with_vllm/test_quill_connector.py and bench/vllm_connector_bench.py."""

from __future__ import annotations

import json
from pathlib import Path


def write_model(directory: Path, layers: int, kv_heads: int, head: int, heads: int | None = None) -> str:
    """A Llama-shaped model's config.json (no weights: the scheduler and KV tensors need none)."""
    heads = heads or kv_heads * 2
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": heads * head,
        "intermediate_size": 2 * heads * head, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "num_hidden_layers": layers, "vocab_size": 1000, "max_position_embeddings": 4096,
        "torch_dtype": "float16", "rms_norm_eps": 1e-5}))
    return str(directory)


def vllm_config(model_dir: str, url: str, role: str = "kv_both", block_size: int = 16, dtype: str = "float16",
                **extra):
    from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
    return VllmConfig(
        model_config=ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype=dtype, max_model_len=4096,
                                 served_model_name="m", seed=0),
        cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=True),
        scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=4096, max_model_len=4096,
                                         is_encoder_decoder=False),
        kv_transfer_config=KVTransferConfig(kv_connector="QuillConnector", kv_connector_module_path="quillclient.vllm",
                                            kv_role=role, kv_connector_extra_config={"url": url, **extra}),
        device_config=DeviceConfig("cpu"))


def kv_cache_config(layout, layer_names: list[str], num_blocks: int, block_size: int, kv_heads: int, head: int,
                    dtype=None):
    """One group of full attention over one backing allocation, in the given physical layout."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=kv_heads, head_size=head,
                             dtype=dtype or torch.float16)
    page, layers = spec.page_size_bytes, len(layer_names)
    if layout.is_layer_compact:
        tensor = KVCacheTensor(size=page * num_blocks * layers, layers=layer_names, layer_stride=page * num_blocks,
                               block_stride=page)
    else:
        tensor = KVCacheTensor(size=page * num_blocks * layers, layers=layer_names, layer_stride=page,
                               block_stride=page * layers)
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[tensor],
                         kv_cache_groups=[KVCacheGroupSpec(layer_names, spec)], kv_cache_layout=layout.name)
