"""Build the demo model that ships in ``dynamo/models/demo`` (deterministically).

The demo model is what ``dynamo serve`` serves by default: a small byte-level BPE tokenizer trained
here on generated text (English-like sentences, code, JSON, and multi-byte UTF-8: accented words,
Greek, Cyrillic, CJK, emoji), a Llama-3-style chat template with tool support, and the config
files a frontend reads. There are no weights: the mocker engine needs none.

Run ``python scripts/build_demo_model.py [--out DIR]``; running it twice gives identical files.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

TRAINED_VOCAB_SIZE = 4080  # + 16 special tokens = 4096
CONTEXT_LENGTH = 8192
SEED = 20261122

NAMED_SPECIAL_TOKENS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|python_tag|>",
    "<|finetune_right_pad_id|>",
]
SPECIAL_TOKENS = NAMED_SPECIAL_TOKENS + [f"<|reserved_special_token_{i}|>" for i in range(8)]
BOS, EOT, END_OF_TEXT, EOM, PAD = (
    "<|begin_of_text|>",
    "<|eot_id|>",
    "<|end_of_text|>",
    "<|eom_id|>",
    "<|finetune_right_pad_id|>",
)

# Llama-3.1-style template: system/user/assistant/tool(ipython) roles, string or list-of-parts
# content, tools rendered as JSON into the first user turn's system preamble, assistant tool calls
# as JSON, and raise_exception on unknown roles or a malformed conversation.
CHAT_TEMPLATE = """\
{%- macro render_content(content) -%}
    {%- if content is string -%}
        {{- content -}}
    {%- elif content is iterable -%}
        {%- for part in content -%}
            {%- if part['type'] == 'text' -%}
                {{- part['text'] -}}
            {%- else -%}
                {{- raise_exception('Unsupported content part type: ' + part['type']) -}}
            {%- endif -%}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = render_content(messages[0]['content']) | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "You are a helpful assistant." %}
{%- endif %}
{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}
{%- if tools is not none and tools is defined and tools | length > 0 %}
    {{- 'Environment: ipython\\n\\n' }}
    {{- 'You have access to the following functions. To call a function, reply with JSON '
        'of the form {"name": function name, "parameters": dictionary of argument name and '
        'value}.\\n\\n' }}
    {%- for tool in tools %}
        {{- tool | tojson(indent=4) }}
        {{- '\\n\\n' }}
    {%- endfor %}
{%- endif %}
{{- system_message + '<|eot_id|>' }}
{%- for message in messages %}
    {%- if message['role'] not in ['user', 'assistant', 'tool', 'ipython'] %}
        {{- raise_exception('Unsupported role: ' + message['role'] + '. Roles must be system '
            '(first message only), user, assistant or tool.') }}
    {%- endif %}
    {%- if message['role'] == 'assistant' and message['tool_calls'] is defined
          and message['tool_calls'] %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
        {%- for tool_call in message['tool_calls'] %}
            {%- set call = tool_call['function'] if tool_call['function'] is defined
                  else tool_call %}
            {{- '{"name": "' + call['name'] + '", "parameters": ' }}
            {%- if call['arguments'] is string %}
                {{- call['arguments'] }}
            {%- else %}
                {{- call['arguments'] | tojson }}
            {%- endif %}
            {{- '}' }}
        {%- endfor %}
        {{- '<|eom_id|>' }}
    {%- elif message['role'] in ['tool', 'ipython'] %}
        {{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' }}
        {{- render_content(message['content']) | trim }}
        {{- '<|eot_id|>' }}
    {%- else %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}
        {{- render_content(message['content']) | trim }}
        {{- '<|eot_id|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

_PARAGRAPHS = [
    "A distributed inference server splits the work of answering a request into stages. The "
    "frontend receives an HTTP request, applies the chat template, tokenizes the prompt and "
    "routes it to a worker. The worker schedules the request, fills its key-value cache during "
    "prefill and then decodes one token at a time until a stop condition is met.",
    "Routing with awareness of the cache sends a request to the worker that already holds the "
    "longest prefix of its prompt, so that less prefill work is repeated. Each block of tokens is "
    "hashed, and the router keeps an index of which worker has which block.",
    "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs! How "
    "vexingly quick daft zebras jump; the five boxing wizards jump quickly.",
    'Example: {"name": "get_weather", "parameters": {"location": "Paris", "unit": "celsius"}}',
    "def fibonacci(n: int) -> int:\n    if n < 2:\n        return n\n    return fibonacci(n - 1) "
    "+ fibonacci(n - 2)\n\nprint([fibonacci(i) for i in range(10)])\n",
    "for (let i = 0; i < items.length; i++) { console.log(items[i].id, items[i].value); }",
    "SELECT user_id, COUNT(*) AS requests FROM logs WHERE status = 200 GROUP BY user_id;",
    "You are a helpful assistant. Answer the question as briefly as you can, and say so when you "
    "do not know the answer. What is the capital of France? The capital of France is Paris.",
]

_MULTILINGUAL = [
    "Un café crème et une crêpe, s'il vous plaît. Le garçon était très naïf à propos du résumé.",
    "Die Straße in München ist schön; Müller fährt über die Brücke zur Universität.",
    "El niño pequeño comió una piña en la mañana del año pasado. ¿Dónde está la estación?",
    "São Paulo é a maior cidade do Brasil. A situação econômica é ótima.",
    "Kraków i Łódź to piękne miasta. Zażółć gęślą jaźń.",
    "Η γρήγορη καφέ αλεπού πηδά πάνω από τον τεμπέλη σκύλο.",
    "Съешь же ещё этих мягких французских булок, да выпей чаю.",
    "你好，世界！我们正在测试分词器。今天天气很好，我们去公园散步吧。人工智能模型需要大量的数据。",
    "日本語のテキストです。東京は日本の首都です。ありがとうございます。",
    "한국어 문장입니다. 서울은 대한민국의 수도입니다. 감사합니다.",
    "Emoji time 😀 🚀 🎉 👍 🏽 ❤️ 🔥 ✨ 🤖 — the model says hi 👋 and waves 🙂.",
    "Mathematics: ∀x ∈ ℝ, x² ≥ 0; π ≈ 3.14159; ∑ 1/n² = π²/6; α, β, γ → ∞.",
]

_WORDS = (
    "the be to of and a in that have it for not on with he as you do at this but his by from "
    "they we say her she or an will my one all would there their what so up out if about who get "
    "which go me when make can like time no just him know take people into year your good some "
    "could them see other than then now look only come its over think also back after use two how "
    "our work first well way even new want because any these give day most us model token server "
    "request worker router cache block prefix decode prefill stream latency throughput frontend "
    "backend engine schedule queue batch memory compute network message system user assistant "
    "function tool call result error status answer question reason context window length limit "
    "sample temperature probability distribution vector matrix tensor layer attention weight "
    "training inference deploy cluster node process thread socket packet protocol client python "
    "rust code test data file string number list value key index hash table tree graph search"
).split()
_SYLLABLES = (
    "ka ri to ne mo shi la ven dor tral ex pro con ment ing tion able ver sa lu mi ter an el or "
    "us ix qua zen bal fer gon hel jas kor lim nar pel quin ros sul tor ulm vix wer yal zor"
).split()


def _sentence(rng: random.Random) -> str:
    words = [rng.choice(_WORDS) for _ in range(rng.randint(5, 14))]
    if rng.random() < 0.3:
        made_up = "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 4)))
        words.insert(rng.randrange(len(words)), made_up)
    if rng.random() < 0.2:
        words.insert(rng.randrange(len(words)), str(rng.randint(0, 100000)))
    text = " ".join(words)
    return text[0].upper() + text[1:] + rng.choice([".", ".", ".", "?", "!", ",", ":"])


def corpus() -> list[str]:
    """The training text: fixed paragraphs, multilingual lines and seeded generated sentences."""
    rng = random.Random(SEED)
    lines = _PARAGRAPHS * 20 + _MULTILINGUAL * 12
    lines += [" ".join(_sentence(rng) for _ in range(rng.randint(1, 4))) for _ in range(6000)]
    rng.shuffle(lines)
    return lines


def build_tokenizer() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TRAINED_VOCAB_SIZE,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus(), trainer=trainer)
    tokenizer.add_special_tokens(SPECIAL_TOKENS)
    bos_id = tokenizer.token_to_id(BOS)
    # Like Llama 3: encode(..., add_special_tokens=True) prepends <|begin_of_text|>.
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return tokenizer


def _dump(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def write_model(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    tokenizer.save(str(out / "tokenizer.json"), pretty=True)
    ids = {token: tokenizer.token_to_id(token) for token in SPECIAL_TOKENS}
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    added = {
        str(ids[token]): {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for token in SPECIAL_TOKENS
    }
    _dump(
        out / "tokenizer_config.json",
        {
            "added_tokens_decoder": added,
            "bos_token": BOS,
            "eos_token": EOT,
            "pad_token": PAD,
            "chat_template": CHAT_TEMPLATE,
            "clean_up_tokenization_spaces": False,
            "model_input_names": ["input_ids", "attention_mask"],
            "model_max_length": CONTEXT_LENGTH,
            "tokenizer_class": "PreTrainedTokenizerFast",
        },
    )
    _dump(
        out / "config.json",
        {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "bos_token_id": ids[BOS],
            "eos_token_id": [ids[END_OF_TEXT], ids[EOM], ids[EOT]],
            "hidden_size": 256,
            "intermediate_size": 768,
            "num_attention_heads": 4,
            "num_hidden_layers": 2,
            "num_key_value_heads": 2,
            "max_position_embeddings": CONTEXT_LENGTH,
            "rms_norm_eps": 1e-05,
            "rope_theta": 500000.0,
            "tie_word_embeddings": True,
            "torch_dtype": "bfloat16",
            "vocab_size": vocab_size,
        },
    )
    _dump(
        out / "generation_config.json",
        {
            "bos_token_id": ids[BOS],
            "eos_token_id": [ids[END_OF_TEXT], ids[EOM], ids[EOT]],
            "do_sample": True,
            "temperature": 0.6,
            "top_p": 0.9,
        },
    )


def main() -> None:
    default_out = Path(__file__).resolve().parent.parent / "dynamo" / "models" / "demo"
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=default_out, help="output directory")
    args = parser.parse_args()
    write_model(args.out)
    for path in sorted(args.out.iterdir()):
        digest = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
        print(f"{path.stat().st_size:>8}  {digest}  {path}")


if __name__ == "__main__":
    main()
