"""The tokenizer of a GGUF (``tokenizer.ggml.*``) gives the ids the Hugging Face tokenizer of the same model
gives. Both are built here from one generated vocabulary: a byte-level BPE trained on a small corpus,
saved as ``tokenizer.json`` the way Qwen2 ships it, and written into a GGUF as ``convert_hf_to_gguf`` does."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors, trainers  # noqa: E402
from tokenizers import Tokenizer as HFTokenizer  # noqa: E402

from engine.gguf_export import _tokenizer_meta  # noqa: E402
from engine.gguf_tokenizer import _QWEN2  # noqa: E402
from engine.tokenizer import Tokenizer, TokenizerError  # noqa: E402

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TRAIN = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "def forward(self, x):\n    return self.linear(x) + 1\n\n\tif x > 0:\n\t\treturn -x\n",
    "Zürich, naïve café, Ελληνικά, русский текст, 日本語のテキスト, 中文句子, 한국어 문장 🙂🚀",
    "numbers 12345 67890 3.14159 1e-5 0x1F; {\"json\": [1, 2, 3]}   spaces    and\n\n\nnewlines",
]
CORPUS = [
    "Hello, world! The quick brown fox.",
    "    indented code:\n\tfor i in range(10):\n\t\tprint(i ** 2)\r\n",
    "Unicode: ñandú, Ελληνικά, 日本語, 中文, 한국어, emoji 🙂🚀👩‍💻, combining e\u0301 vs é",
    "whitespace runs:      \n\n\n   \t\t  end   ",
    "numbers 1234567890 and 3.14159e-10, hex 0xDEADBEEF",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "special in the middle<|endoftext|>and after",
    "don't won't I'm they're we've I'll he'd",
    "",
    " leading space and trailing space ",
]


def _hf_tokenizer(path: Path) -> None:
    tok = HFTokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_QWEN2), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(TRAIN * 5, trainer)
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "chat_template": TEMPLATE}))


def _gguf(src: Path, out: Path) -> None:
    w = gguf.GGUFWriter(str(out), "qwen2")
    eos = _tokenizer_meta(w, src)
    assert eos is not None
    w.add_eos_token_id(eos)
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_tokenizer_ids_equal_hugging_face(tmp_path: Path) -> None:
    _hf_tokenizer(tmp_path / "hf")
    _gguf(tmp_path / "hf", tmp_path / "m.gguf")
    ref = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "hf" / "tokenizer.json"))
    mine = Tokenizer.load(tmp_path / "m.gguf")
    assert mine.vocab_size == len(ref)
    for text in CORPUS:
        want = ref.encode(text, add_special_tokens=False)
        assert mine.encode(text, add_special_tokens=False) == want, text
        assert mine.encode(text) == ref.encode(text), text
        assert mine.decode(want, skip_special_tokens=False) == ref.decode(want, skip_special_tokens=False)
    assert mine.is_special(ref.convert_tokens_to_ids("<|im_end|>"))
    assert mine.eos_ids == {ref.convert_tokens_to_ids("<|im_end|>")}
    chat = [{"role": "user", "content": "héllo   there\n\tcode"}]
    assert mine.apply_chat_template(chat, tokenize=False) == (
        "<|im_start|>user\nhéllo   there\n\tcode<|im_end|>\n<|im_start|>assistant\n")
    text = mine.apply_chat_template(chat, tokenize=False)
    assert mine.apply_chat_template(chat) == ref.encode(text, add_special_tokens=False)


def test_unsupported_tokenizer_is_named(tmp_path: Path) -> None:
    w = gguf.GGUFWriter(str(tmp_path / "spm.gguf"), "llama")
    w.add_tokenizer_model("t5")
    w.add_token_list(["<unk>", "a"])
    w.add_tensor("token_embd.weight", np.zeros((2, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(TokenizerError, match="tokenizer.ggml.model 't5' is not supported"):
        Tokenizer.load(tmp_path / "spm.gguf")


def test_export_without_a_tokenizer_writes_model_none(tmp_path: Path) -> None:
    """A checkpoint with no tokenizer.json is written with tokenizer.ggml.model "none", the key llama.cpp
    requires of every file (it refused ours with 'key not found in model: tokenizer.ggml.model'); the engine
    still loads the weights, and asking the file for its tokenizer says there is none."""
    from gguf_helpers import QWEN3_MOE, build

    from engine.gguf_export import export_gguf
    from engine.model import Model

    build("Qwen3MoeConfig", "Qwen3MoeForCausalLM", tmp_path / "src", **QWEN3_MOE)
    assert not (tmp_path / "src" / "tokenizer.json").exists()
    g = tmp_path / "no-vocab.gguf"
    export_gguf(tmp_path / "src", g, "Q8_0")
    fields = gguf.GGUFReader(str(g)).fields
    assert fields["tokenizer.ggml.model"].contents() == "none"
    assert fields["qwen3moe.vocab_size"].contents() == QWEN3_MOE["vocab_size"]
    m = Model.load(g)
    assert m.forward([1, 2, 3], m.new_cache(8)).shape == (3, QWEN3_MOE["vocab_size"])
    with pytest.raises(TokenizerError, match=r"has no tokenizer \(tokenizer.ggml.model 'none'\)"):
        Tokenizer.load(g)


def test_export_writes_one_eos_id(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from engine.gguf_export import export_gguf

    g = _q4km_gguf(tmp_path)
    assert not [r for r in caplog.records if "Duplicated key" in r.getMessage()]
    eos = gguf.GGUFReader(str(g)).fields["tokenizer.ggml.eos_token_id"]
    ref = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "src" / "tokenizer.json"))
    assert int(eos.parts[eos.data[0]][0]) == ref.convert_tokens_to_ids("<|im_end|>")  # config.json has none

    g2 = tmp_path / "with-config-eos.gguf"
    cfg = json.loads((tmp_path / "src" / "config.json").read_text())
    (tmp_path / "src" / "config.json").write_text(json.dumps({**cfg, "eos_token_id": [7, 9]}))
    caplog.clear()
    export_gguf(tmp_path / "src", g2, "F32")
    assert not [r for r in caplog.records if "Duplicated key" in r.getMessage()]
    eos = gguf.GGUFReader(str(g2)).fields["tokenizer.ggml.eos_token_id"]
    assert int(eos.parts[eos.data[0]][0]) == 7


def _q4km_gguf(tmp_path: Path) -> Path:
    from engine.gguf_export import export_gguf
    from gguf_helpers import QWEN3_MOE, build

    _hf_tokenizer(tmp_path / "src")
    vocab = len(json.loads((tmp_path / "src" / "tokenizer.json").read_text())["model"]["vocab"]) + len(SPECIALS)
    build("Qwen3MoeConfig", "Qwen3MoeForCausalLM", tmp_path / "src", **{**QWEN3_MOE, "vocab_size": vocab})
    g = tmp_path / "tiny-q4km.gguf"
    export_gguf(tmp_path / "src", g, "Q4_K_M")
    return g


def test_api_serves_a_gguf_with_its_chat_template(tmp_path: Path) -> None:
    """The OpenAI API over real HTTP on a GGUF: listed under the file's name, chat rendered with the GGUF's
    template, greedy output equal to the engine run directly."""
    import openai
    from api_helpers import LoopThread

    from engine.generate import generate
    from engine.sampling import SamplingParams
    from meshd.api.engine_backend import load_engine_backend
    from meshd.api.server import ApiConfig, ApiServer

    g = _q4km_gguf(tmp_path)
    lt = LoopThread()
    backend = load_engine_backend(str(g), tmp_path / "state", max_active=1)
    server = ApiServer(ApiConfig("gguf-node"), [backend])
    lt.run(server.start("127.0.0.1", 0))
    try:
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{server.address[1]}/v1", api_key="x", max_retries=0)
        assert [m.id for m in c.models.list().data] == ["tiny-q4km"]
        msgs = [{"role": "user", "content": "hello mesh"}]
        r = c.chat.completions.create(model="tiny-q4km", messages=msgs, max_tokens=5, temperature=0)
        src = backend.source
        ids = src.tokenizer.apply_chat_template(msgs, add_generation_prompt=True)
        assert ids[:1] == [src.tokenizer.token_to_id("<|im_start|>")]
        want = "".join(e.text for e in generate(src.model, src.tokenizer, ids,
                                                SamplingParams(max_tokens=5, temperature=0.0)))
        assert r.choices[0].message.content == want and r.usage.prompt_tokens == len(ids)
    finally:
        lt.run(server.stop())
        lt.close()


def test_meshd_generate_runs_a_quantized_gguf_end_to_end(tmp_path: Path) -> None:
    """A real `meshd generate` process on a Q4_K_M GGUF whose tokenizer and chat template come from it."""
    import subprocess
    import sys

    from engine.model import Model

    g = _q4km_gguf(tmp_path)
    p = subprocess.run([sys.executable, "-m", "meshd", "generate", "--model", str(g), "--prompt", "hello mesh",
                        "--max-tokens", "5", "--temperature", "0", "--ignore-eos", "--json",
                        "--state-dir", str(tmp_path / "st")], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    # the same greedy tokens as the engine in this process on the same file
    tok = Tokenizer.load(g)
    model = Model.load(g)
    ids = tok.encode("hello mesh")
    cache = model.new_cache()
    logits = model.forward(ids, cache)[-1]
    want = []
    for _ in range(5):
        want.append(int(logits.argmax()))
        logits = model.forward([want[-1]], cache)[-1]
    assert out["text"] == tok.decode(want), (out, want)
