#!/usr/bin/env python3
"""Builds the engine-tokenizer test fixture (workload/tests/fixtures/engine-tokenizer/) and its
expected values, with Hugging Face's own libraries (the ones vLLM's server uses), independently of
headroom's Rust code:

- tokenizer.json: the tiny byte-level BPE of scripts/make_tokenizer.py (trained offline, seeded),
  plus Llama-3-style special tokens and a post-processor that prepends <|begin_of_text|>;
- tokenizer_config.json: bos/eos tokens and a Llama-3-style chat template written for this test
  (system prompt, date, tools as JSON, string methods, raise_exception, generation prompt);
- vectors.json: for each request body, the rendered prompt and token ids from transformers'
  apply_chat_template(tokenize=False) and the tokenizer (add_special_tokens as vLLM's server sets
  it), and the vLLM sha256_cbor event hashes (PYTHONHASHSEED=0, 16-token blocks) from cbor2.

Needs: tokenizers, transformers, cbor2 (e.g. the guidellm venv of scripts/guidellm-common.sh plus
`pip install cbor2`).  Usage: engine_tokenizer_fixture.py OUT_DIR
"""
import hashlib
import json
import os
import subprocess
import sys
import tempfile

import cbor2
from tokenizers import AddedToken, Tokenizer, processors
from transformers import PreTrainedTokenizerFast

OUT = sys.argv[1]
SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
TEMPLATE = """{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'].strip() %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{%- if date_string is not defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if tools is not none %}
    {{- "Tools:\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n" }}
    {%- endfor %}
{%- endif %}
{{- "Today Date: " + date_string + "\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {%- if message['role'] not in ['user', 'assistant', 'tool'] %}
        {{- raise_exception("unknown role " + message['role']) }}
    {%- endif %}
    {%- if message.tool_calls is defined and message.tool_calls %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
        {%- for call in message.tool_calls %}
            {{- call.function | tojson }}
        {%- endfor %}
        {{- '<|eot_id|>' }}
    {%- else %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

os.makedirs(OUT, exist_ok=True)
with tempfile.TemporaryDirectory() as tmp:
    here = os.path.dirname(os.path.abspath(__file__))
    subprocess.run([sys.executable, os.path.join(here, "make_tokenizer.py"), tmp], check=True)
    tok = Tokenizer.from_file(os.path.join(tmp, "tokenizer.json"))
tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
bos = tok.token_to_id("<|begin_of_text|>")
tok.post_processor = processors.TemplateProcessing(
    single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A $B", special_tokens=[("<|begin_of_text|>", bos)]
)
tok.save(os.path.join(OUT, "tokenizer.json"))
config = {
    "bos_token": "<|begin_of_text|>",
    "eos_token": {"content": "<|eot_id|>", "special": True},
    "chat_template": TEMPLATE,
    "tokenizer_class": "PreTrainedTokenizerFast",
}
with open(os.path.join(OUT, "tokenizer_config.json"), "w") as f:
    json.dump(config, f, indent=2, ensure_ascii=False)
    f.write("\n")

hf = PreTrainedTokenizerFast(tokenizer_file=os.path.join(OUT, "tokenizer.json"),
                             bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")
hf.chat_template = TEMPLATE


def vllm_hashes(ids, block=16, seed="0"):
    h = lambda x: hashlib.sha256(cbor2.dumps(x, canonical=True)).digest()
    parent, out = h(seed), []
    for i in range(len(ids) // block):
        parent = h((parent, tuple(ids[i * block:(i + 1) * block]), None))
        out.append(int.from_bytes(parent[-8:], "big"))
    return out


weather = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city, e.g. Zürich",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
cases = [
    ("chat", {"messages": [{"role": "system", "content": "  You answer briefly.  "},
                           {"role": "user", "content": "What is the capital of France? Answer in one word."}]}),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "text", "text": "Describe"}, {"type": "text", "text": "this, please."}]}],
              "chat_template_kwargs": {"date_string": "1 Dec 2026"}}),
    ("chat", {"messages": [{"role": "user", "content": "Weather in Zürich?"},
                           {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Zürich\"}"}}]},
                           {"role": "tool", "content": "12 °C, cloudy"}],
              "tools": [weather]}),
    ("chat", {"messages": [{"role": "user", "content": "Continue the story about the fox and the dog"}],
              "add_generation_prompt": False}),
    ("completion", {"prompt": "The quick brown fox jumps over the lazy dog, and then the dog sleeps all day long in the sun."}),
]
vectors = []
for kind, body in cases:
    if kind == "chat":
        msgs = [dict(m, content="\n".join(p["text"] for p in m["content"] if p["type"] == "text"))
                if isinstance(m.get("content"), list) else m for m in body["messages"]]
        rendered = hf.apply_chat_template(msgs, tools=body.get("tools"), tokenize=False,
                                          add_generation_prompt=body.get("add_generation_prompt", True),
                                          **body.get("chat_template_kwargs", {}))
        ids = hf(rendered, add_special_tokens=False).input_ids
    else:
        rendered = body["prompt"]
        ids = hf(rendered, add_special_tokens=True).input_ids
    vectors.append({"endpoint": kind, "body": body, "rendered": rendered, "ids": ids, "vllm_hashes_seed0": vllm_hashes(ids)})
with open(os.path.join(OUT, "vectors.json"), "w") as f:
    json.dump(vectors, f, indent=1, ensure_ascii=False)
    f.write("\n")
print(f"wrote {OUT}: {len(vectors)} vectors")
