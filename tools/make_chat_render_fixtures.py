"""Golden token ids for quilld/index/chat_render.py, made by transformers and vLLM's own renderer.

    /work/vllm-venv/bin/python tools/make_chat_render_fixtures.py [--out tests/fixtures/chat_render]

Run it by hand with a Python that has vLLM 0.33 (and so transformers 5 and torch) installed, in
a private venv, never the project's (see tools/make_vllm_hash_fixtures.py for how). No hub
access: it builds its tokenizer directories itself. For each family it trains a small
byte-level BPE with the `tokenizers` library, with the family's own pre-tokenizer, special
tokens and post-processor, and writes the family's published chat template (Llama 3.1
instruct's and Qwen 2.5 instruct's tokenizer_config.json `chat_template`, in
tests/fixtures/chat_render/templates/) into the directory's tokenizer_config.json, or, for
`qwen25_jinja`, into a chat_template.jinja beside a config naming `add_bos_token` (ignored by
transformers 5 when a tokenizer.json exists) and a BOS the vocabulary lacks.

Then for each conversation it records what vLLM feeds the engine: the token ids of vLLM's
`HfRenderer.render_messages` (its message parser, template resolution, kwargs filter and
tokenizer call; a ModelConfig of a tiny config.json beside the tokenizer, no weights loaded)
and checks that transformers' `AutoTokenizer.apply_chat_template(..., tokenize=True)` agrees on
the parsed conversation; and for each completions prompt, `tokenizer.encode(prompt,
add_special_tokens=True)` as vLLM's completions path calls it. quilld's unit tests
(tests/unit/test_chat_render.py) need neither: they read the directories and cases.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "chat_render"
TEMPLATES = OUT / "templates"

LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                  "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"]
QWEN2_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"]

WORDS = ("the a of to and in is it you that he was for on are with as I his they be at one have this from or "
         "had by word but what some we can out other were all there when up use your how said an each she which "
         "do their time if will way about many then them write would like so these her long make thing see him "
         "two has look more day could go come did number sound no most people my over know water than call first "
         "who may down side been now find any new work part take get place made live where after back little only "
         "round man year came show every good me give our under name very through just form sentence great think "
         "cache block prefix engine token route pool request tenant hash vLLM Qwen Llama assistant system user "
         "café naïve résumé 東京 données über 42 1999 3.14 {\"json\": true} <tag> #heading - bullet").split()


def corpus(n: int) -> list[str]:
    lines, k = [], 0
    for i in range(n):
        line = []
        for j in range(6 + i % 17):
            k = (k * 1103515245 + 12345) % (2 ** 31)
            line.append(WORDS[k % len(WORDS)])
        lines.append(" ".join(line) + ("\n\n" if i % 5 == 0 else ". "))
    return lines


def train(split: str, special: list[str], nfc: bool, bos: str | None):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
    from tokenizers.models import BPE
    from tokenizers.trainers import BpeTrainer

    tok = Tokenizer(BPE(dropout=None, unk_token=None, continuing_subword_prefix="", end_of_word_suffix="",
                        fuse_unk=False, byte_fallback=False))
    if nfc:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(vocab_size=1200, min_frequency=2, show_progress=False,
                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    tok.train_from_iterator(corpus(3000), trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    if bos is None:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    else:
        tok.post_processor = processors.Sequence([
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                          special_tokens=[(bos, tok.token_to_id(bos))])])
    return tok


def tiny_model_config(family: str) -> dict:
    """A config.json of a two-layer model of the family, so vLLM's ModelConfig can be built (no weights)."""
    arch = {"llama31": ("LlamaForCausalLM", "llama")}.get(family, ("Qwen2ForCausalLM", "qwen2"))
    return {"architectures": [arch[0]], "model_type": arch[1], "hidden_size": 64, "intermediate_size": 128,
            "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 1300,
            "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "torch_dtype": "float32",
            "tie_word_embeddings": True}


def build_dirs(out: Path) -> dict[str, Path]:
    llama_t = (TEMPLATES / "llama31_instruct.jinja").read_text(encoding="utf-8")
    qwen_t = (TEMPLATES / "qwen25_instruct.jinja").read_text(encoding="utf-8")
    rules_t = (TEMPLATES / "environment_rules.jinja").read_text(encoding="utf-8")
    dirs = {}
    llama = train(LLAMA3_SPLIT, LLAMA3_SPECIAL, nfc=False, bos="<|begin_of_text|>")
    qwen = train(QWEN2_SPLIT, QWEN2_SPECIAL, nfc=True, bos=None)
    specs = {
        "llama31": (llama, {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "chat_template": llama_t,
                            "clean_up_tokenization_spaces": True, "model_max_length": 131072,
                            "tokenizer_class": "PreTrainedTokenizerFast"}, None),
        "qwen25": (qwen, {"add_prefix_space": False, "bos_token": None, "chat_template": qwen_t,
                          "clean_up_tokenization_spaces": False, "eos_token": "<|im_end|>", "errors": "replace",
                          "model_max_length": 131072, "pad_token": "<|endoftext|>", "split_special_tokens": False,
                          "tokenizer_class": "Qwen2Tokenizer", "unk_token": None}, None),
        "qwen25_jinja": (qwen, {"add_bos_token": True, "bos_token": {"__type": "AddedToken", "content": "<|extra_bos|>", "lstrip": False,
                                              "normalized": False, "rstrip": False, "single_word": False,
                                              "special": True},
                                "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
                                "tokenizer_class": "Qwen2Tokenizer"}, qwen_t),
        "environment_rules": (qwen, {"eos_token": "<|im_end|>", "tokenizer_class": "Qwen2Tokenizer"}, rules_t),
    }
    for name, (tok, config, jinja) in specs.items():
        d = out / name
        if d.exists():
            shutil.rmtree(d)
        d.mkdir(parents=True)
        tok.save(str(d / "tokenizer.json"))
        (d / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n",
                                                 encoding="utf-8")
        if jinja is not None:
            (d / "chat_template.jinja").write_text(jinja, encoding="utf-8")
        dirs[name] = d
    return dirs


LONG = " ".join(corpus(120))
SYSTEM = "You are a concise assistant for QuillCache operators."
CHATS = [  # (name, messages, options)
    ("system_user", [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "How do I route a request?"}],
     {}),
    ("user_only", [{"role": "user", "content": "Hello there"}], {}),
    ("multi_turn", [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is a block?"},
                    {"role": "assistant", "content": "A block is 16 tokens of KV cache."},
                    {"role": "user", "content": "And a prefix?"}], {}),
    ("multi_turn_no_generation_prompt", [{"role": "system", "content": SYSTEM},
                                         {"role": "user", "content": "What is a block?"},
                                         {"role": "assistant", "content": "A block is 16 tokens of KV cache."},
                                         {"role": "user", "content": "And a prefix?"}],
     {"add_generation_prompt": False}),
    ("assistant_turn_last", [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name a tier."},
                             {"role": "assistant", "content": "  DRAM, then SSD.  "}],
     {"add_generation_prompt": False}),
    ("continue_final_message", [{"role": "user", "content": "Count to three."},
                                {"role": "assistant", "content": "One, two,"}],
     {"add_generation_prompt": False, "continue_final_message": True}),
    ("content_parts", [{"role": "system", "content": [{"type": "text", "text": SYSTEM}]},
                       {"role": "user", "content": [{"type": "text", "text": "first part"},
                                                    {"type": "text", "text": "second part"}]}], {}),
    ("none_fields_dropped", [{"role": "user", "content": "hi", "name": None},
                             {"role": "assistant", "content": "hello", "tool_calls": None},
                             {"role": "user", "content": "again"}], {}),
    ("special_token_in_text", [{"role": "user", "content": "say <|eot_id|> and <|im_end|> literally"}], {}),
    ("unicode_and_whitespace", [{"role": "system", "content": "\n  Caf\u0065\u0301 na\u00efve \u6771\u4eac  \n"},
                                {"role": "user", "content": "tabs\tand\r\nnewlines \U0001F600 ok"}], {}),
    ("developer_role", [{"role": "developer", "content": "Answer in French."},
                        {"role": "user", "content": "Good morning"}], {}),
    ("template_kwargs", [{"role": "user", "content": "What day is it?"}],
     {"chat_template_kwargs": {"date_string": "02 Dec 2026", "not_a_template_variable": "dropped"}}),
    ("tool_turns", [{"role": "user", "content": "weather?"},
                    {"role": "assistant", "content": "", "tool_calls": [
                        {"id": "c1", "type": "function", "function": {"name": "get_weather",
                                                                      "arguments": "{\"city\": \"Paris\"}"}}]},
                    {"role": "tool", "content": [{"type": "text", "text": "sunny"}], "tool_call_id": None},
                    {"role": "skip", "content": "not rendered by environment_rules"},
                    {"role": "user", "content": "and <b>tomorrow</b> & caf\u00e9?"},
                    {"role": "assistant", "content": "cloudy"}, {"role": "user", "content": "cut by break"}],
     {"add_generation_prompt": False}),
    ("long_user_message", [{"role": "system", "content": SYSTEM}, {"role": "user", "content": LONG}], {}),
]
PROMPTS = [("hello", "Hello world"), ("empty", ""), ("special_token", "<|im_start|>user\nhi<|eot_id|>"),
           ("long", LONG), ("unicode", "Caf\u0065\u0301 \U0001F600 \u6771\u4eac"),
           ("a_config_only_special_token", "x <|extra_bos|> y")]  # qwen25_jinja: added from its config


def vllm_renderer(d: Path, family: str):
    """vLLM's own HfRenderer for the directory (a ModelConfig of a tiny config.json, no weights)."""
    from vllm.config import DeviceConfig, ModelConfig, VllmConfig
    from vllm.renderers.hf import HfRenderer
    from vllm.tokenizers import get_tokenizer

    (d / "config.json").write_text(json.dumps(tiny_model_config(family)), encoding="utf-8")
    try:
        mc = ModelConfig(model=str(d), tokenizer=str(d), dtype="float32", max_model_len=4096)
        return HfRenderer(VllmConfig(model_config=mc, device_config=DeviceConfig(device="cpu")), get_tokenizer(str(d)))
    finally:
        (d / "config.json").unlink()


def vllm_chat_ids(renderer, messages, options) -> tuple[list[int], list[dict]]:
    from vllm.renderers.params import ChatParams

    kwargs = {"add_generation_prompt": options.get("add_generation_prompt", True),
              "continue_final_message": options.get("continue_final_message", False),
              **options.get("chat_template_kwargs", {})}
    conversation, prompt = renderer.render_messages(json.loads(json.dumps(messages)), ChatParams(
        chat_template=None, chat_template_content_format="auto", chat_template_kwargs=kwargs))
    return list(prompt["prompt_token_ids"]), conversation


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    try:
        import transformers
        import vllm
        from transformers import AutoTokenizer
        from vllm.renderers.hf import _consolidate_system_messages, _convert_developer_to_system
    except ImportError as e:
        print(f"vLLM is not importable here ({e}): run this with a Python that has vLLM 0.33 and its "
              f"transformers installed (a private venv, see --help)", file=sys.stderr)
        return 1
    dirs = build_dirs(args.out)
    cases: dict = {"made_by": {"vllm": vllm.__version__, "transformers": transformers.__version__,
                               "script": "tools/make_chat_render_fixtures.py"}, "chat": [], "completion": []}
    for family, d in dirs.items():
        renderer = vllm_renderer(d, family)
        hf = AutoTokenizer.from_pretrained(str(d))
        for name, messages, options in CHATS:
            ids, conversation = vllm_chat_ids(renderer, messages, options)
            if any(m["role"] == "developer" for m in conversation):  # what vLLM's safe_apply_chat_template does next
                conversation = _consolidate_system_messages(_convert_developer_to_system(conversation))
            hf_ids = hf.apply_chat_template(
                conversation, tokenize=True, return_dict=False,
                add_generation_prompt=options.get("add_generation_prompt", True),
                continue_final_message=options.get("continue_final_message", False),
                **{k: v for k, v in options.get("chat_template_kwargs", {}).items() if k == "date_string"})
            if list(hf_ids) != ids:
                print(f"{family}/{name}: vLLM and transformers disagree", file=sys.stderr)
                return 1
            text = hf.apply_chat_template(conversation, tokenize=False,
                                          add_generation_prompt=options.get("add_generation_prompt", True),
                                          continue_final_message=options.get("continue_final_message", False),
                                          **{k: v for k, v in options.get("chat_template_kwargs", {}).items()
                                             if k == "date_string"})
            cases["chat"].append({"dir": family, "name": name, "messages": messages, "options": options,
                                  "text": text, "token_ids": ids})
        for name, prompt in PROMPTS:
            ids = renderer.tokenizer.encode(prompt, add_special_tokens=True)
            cases["completion"].append({"dir": family, "name": name, "prompt": prompt, "token_ids": list(ids)})
    from vllm.renderers.hf import _detect_content_format
    cases["content_format"] = {t.name: _detect_content_format(t.read_text(encoding="utf-8"), default="string")
                               for t in sorted(TEMPLATES.glob("*.jinja"))}
    path = args.out / "cases.json"
    with open(path, "w", encoding="utf-8") as f:
        f.write("{\n" + f'"made_by": {json.dumps(cases["made_by"])},\n')
        f.write(f'"content_format": {json.dumps(cases["content_format"])},\n')
        for key in ("chat", "completion"):
            f.write(f'"{key}": [\n' + ",\n".join(json.dumps(c, ensure_ascii=False) for c in cases[key]) + "\n]"
                    + (",\n" if key == "chat" else "\n"))
        f.write("}\n")
    print(f"wrote {path}: {len(cases['chat'])} chats, {len(cases['completion'])} prompts in {len(dirs)} directories")
    return 0


if __name__ == "__main__":
    sys.exit(main())
