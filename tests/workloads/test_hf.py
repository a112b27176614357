"""Hugging Face causal LMs from local folders: tiny GPT-2s built from a config (nothing is downloaded)."""

from __future__ import annotations

import json
import math
import shutil
import socket
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from conftest import cli_env, saturate_cmd  # noqa: E402
from saturate.data.chat import ChatFormat  # noqa: E402
from saturate.data.tokenizer import BPETokenizer  # noqa: E402
from saturate.engine.step import Stepper  # noqa: E402
from saturate.engine.trainer import RunConfig, train  # noqa: E402
from saturate.errors import ConfigError  # noqa: E402
from saturate.plan import Plan  # noqa: E402
from saturate.run.flow import reference_plans  # noqa: E402
from saturate.workloads import hf  # noqa: E402

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def make_folder(out: Path, *, weights: bool = False, vocab_rows: int | None = None, chat: bool = False,
                bpe: int = 400) -> Path:
    """A 2-layer GPT-2 (~40k parameters) and a 400-token BPE trained here, saved as save_pretrained does."""
    transformers = hf.transformers_module()
    texts = [Path(sysconfig.get_paths()["stdlib"], "textwrap.py").read_text()]
    trained = BPETokenizer.train(texts, bpe)
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=trained._hf, eos_token="<|endoftext|>")
    if chat:
        tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(out)
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=64, vocab_size=vocab_rows or len(tok),
                                     bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id)
    config.save_pretrained(out)
    if weights:
        torch.manual_seed(1)
        transformers.GPT2LMHeadModel(config).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {"config": make_folder(root / "config"), "weights": make_folder(root / "weights", weights=True),
            "chat": make_folder(root / "chat", chat=True)}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("hfcorpus")
    shutil.copy(Path(sysconfig.get_paths()["stdlib"], "difflib.py"), folder / "difflib.py")
    return folder


def test_gpt2_from_a_config_trains_on_a_local_corpus(tmp_path, folders, corpus, cpu, monkeypatch):
    def no_network(*args, **kwargs):
        raise AssertionError("network access attempted")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    w = hf.hf_workload(folders["config"], data=[str(corpus)], seq_len=32, effective_batch=8, steps=3,
                       warmup_steps=1)
    assert w.info["attention"] == "sdpa" and w.info["tokenizer"].startswith("hf-400-")
    assert w.guide_plans == ("rocm-after",) and w.tokens_per_sample == 32
    assert [label for label, _ in reference_plans(w, "cuda")] == ["naive", "guide: rocm-after"]
    model = w.build_model()
    assert model.config._attn_implementation == "sdpa"
    embedding = sum(p.numel() for n, p in model.named_parameters() if "wpe" in n)
    n = sum(p.numel() for p in model.parameters()) - embedding
    assert w.flops_per_sample == pytest.approx((6 * n + 12 * 2 * 32 * 32) * 32)  # 6N + 12·L·C·T per token
    result = train(w, Plan(micro_batch=4, grad_accum=2), RunConfig(run_dir=tmp_path / "run", steps=3, progress=False,
                                                                   tensorboard=False), hardware=cpu)
    assert result.steps == 3 and result.mfu and result.val_loss == pytest.approx(math.log(400), rel=0.1)
    # The export opens in Transformers as it is: weights, config and the tokenizer the data went through.
    from safetensors.torch import load_file

    tf = hf.transformers_module()
    run = tmp_path / "run"
    loaded = tf.AutoModelForCausalLM.from_pretrained(run, local_files_only=True)
    exported = load_file(run / "model.safetensors")
    state = loaded.state_dict()
    assert exported and all(torch.equal(state[k], v) for k, v in exported.items())
    assert loaded.config.use_cache and loaded.config.n_layer == 2
    assert len(tf.AutoTokenizer.from_pretrained(run, local_files_only=True)) == 400
    import os

    assert os.environ["HF_HUB_OFFLINE"] == "1"


def test_local_weights_are_loaded_and_tokenizer_cache_is_keyed_by_the_tokenizer(tmp_path, folders, corpus):
    from transformers import GPT2LMHeadModel

    w = hf.hf_workload(folders["weights"], data=[str(corpus)], seq_len=32)
    saved = GPT2LMHeadModel.from_pretrained(folders["weights"])
    built = w.build_model()
    assert all(torch.equal(saved.state_dict()[k], v) for k, v in built.state_dict().items())
    assert w.info["weights"] == "local"
    same_tokenizer = hf.hf_workload(folders["config"], data=[str(corpus)], seq_len=32)
    other_tokenizer = hf.hf_workload(make_folder(tmp_path / "other", bpe=350), data=[str(corpus)], seq_len=32)
    # Token shards are cached by content and tokenizer: the same tokenizer files share them, others do not.
    assert same_tokenizer.info["corpus_tokens"] == w.info["corpus_tokens"]
    assert w.identity["data"]["corpus"] == same_tokenizer.identity["data"]["corpus"]
    assert w.identity["data"]["corpus"] != other_tokenizer.identity["data"]["corpus"]
    assert w.identity["model"] != same_tokenizer.identity["model"]  # weights vs none

    # GPT-2 fine-tuning end to end through the command line (in-process: Transformers is already imported)
    from saturate import cli

    run_dir = tmp_path / "finetune"
    assert cli.main(["train", "--hf", str(folders["weights"]), "--data", str(corpus), "--param", "seq_len=32",
                     "--effective-batch", "4", "--steps", "2", "--run-dir", str(run_dir), "--no-progress"]) == 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["mfu"] > 0 and summary["val_loss"] > 0
    assert json.loads((run_dir / "run.json").read_text())["info"]["weights"] == "local"


def test_activation_checkpointing_uses_the_models_own_switch(folders, corpus):
    w = hf.hf_workload(folders["config"], data=[str(corpus)], seq_len=32, effective_batch=4)
    batch = tuple(torch.stack(t) for t in zip(*[w.train_data[i] for i in range(4)], strict=True))
    grads = []
    for ac in (False, True):
        torch.manual_seed(0)
        stepper = Stepper(w, Plan(micro_batch=4, activation_checkpointing=ac), torch.device("cpu"), 1e-3,
                          compile=False)
        on = getattr(type(stepper.model), "is_activation_checkpointing", None)  # Transformers 5; 4.x below
        assert (on.__get__(stepper.model) if on is not None else stepper.model.is_gradient_checkpointing) is ac
        w.loss_fn(stepper.model, batch).backward()
        grads.append([p.grad.clone() for p in stepper.model.parameters()])
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(*grads, strict=True))


def test_packed_sequences_stay_apart_in_transformers(folders):
    model = hf.open_folder(folders["config"]).build().eval()
    a, b = torch.randint(0, 400, (1, 10)), torch.randint(0, 400, (1, 7))
    pos = torch.cat([torch.arange(10), torch.arange(7)])[None]
    with torch.no_grad():
        packed = hf.hf_forward(model, torch.cat([a, b], 1), pos)
        alone = model(input_ids=b).logits
    assert torch.allclose(packed[0, 10:], alone[0], atol=1e-5)


def test_chat_template_of_the_tokenizer_marks_the_responses(folders, tmp_path, cpu):
    folder = hf.open_folder(folders["chat"])
    fmt = ChatFormat(folder.tokenizer)
    assert fmt.uses_tokenizer_template
    ids, mask = fmt.encode([{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "general"}])
    assert folder.tokenizer.decode(ids[mask]) == "general<|end|>"  # the response and its end tag, not the header
    assert folder.tokenizer.decode(ids[~mask]) == "<|user|>hello there<|end|><|assistant|>"

    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"prompt": f"say {i}", "response": f"{i} {i}"}) + "\n" for i in range(20)))
    w = hf.hf_workload(folders["chat"], task="sft", data=[str(chats)], seq_len=64, effective_batch=4, steps=2,
                       warmup_steps=1)
    assert w.info["template"].startswith("tokenizer-") and w.name.endswith("-sft")
    result = train(w, Plan(micro_batch=2, grad_accum=2), RunConfig(run_dir=tmp_path / "run", steps=2, progress=False,
                                                                   tensorboard=False), hardware=cpu)
    assert result.steps == 2 and result.val_loss is not None


def test_bad_folders_are_one_line_before_training(tmp_path, folders, corpus):
    (tmp_path / "empty").mkdir()
    mismatch = make_folder(tmp_path / "mismatch", vocab_rows=300)
    no_tokenizer = tmp_path / "no-tokenizer"
    shutil.copytree(folders["weights"], no_tokenizer)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (no_tokenizer / name).unlink()
    vit = tmp_path / "vit"
    vit.mkdir()
    (vit / "config.json").write_text(json.dumps({"model_type": "vit"}))
    cases = {
        tmp_path / "missing": "no such folder",
        tmp_path / "empty": "no config.json",
        mismatch: "the tokenizer has 400 tokens but the model's embedding has 300 rows",
        no_tokenizer: "weights but no tokenizer files",
        vit: "model type 'vit' is not a causal language model",
    }
    for path, message in cases.items():
        with pytest.raises(ConfigError) as e:
            hf.hf_workload(path, data=[str(corpus)])
        assert message in str(e.value) and "\n" not in str(e.value) and str(path.name) in str(e.value)
    with pytest.raises(ConfigError, match="seq_len 100 is longer than the model's 64 positions"):
        hf.hf_workload(folders["config"], data=[str(corpus)], seq_len=100)


def test_without_transformers_the_error_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers now raises ImportError
    with pytest.raises(ConfigError, match=r"pip install 'saturate\[hf\]'"):
        hf.transformers_module()


@pytest.mark.slow
def test_cli_hf_no_config_fails_fast(tmp_path):
    (tmp_path / "model").mkdir()
    out = subprocess.run(saturate_cmd("tune", "--hf", "model", "--out", "t"), cwd=tmp_path, env=cli_env(),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stderr.startswith("saturate: error: --hf model: no config.json")
    assert not (tmp_path / "t").exists()


def test_load_model_reopens_an_hf_run(tmp_path, folders, corpus, cpu):
    """saturate.load_model opens an --hf run's folder through Transformers: the trained weights, tied head included."""
    import saturate
    from saturate.engine.checkpoint import load_checkpoint

    w = hf.hf_workload(folders["config"], data=[str(corpus)], seq_len=32, effective_batch=4, steps=2, warmup_steps=1)
    result = train(w, Plan(micro_batch=4), RunConfig(run_dir=tmp_path / "run", steps=2, progress=False,
                                                     tensorboard=False, telemetry=False), hardware=cpu)
    model = saturate.load_model(result.run_dir)
    reference = w.build_model()
    reference.load_state_dict(load_checkpoint(result.checkpoint)["model"])
    reference.eval()
    x = torch.randint(0, 400, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(input_ids=x).logits, reference(input_ids=x, use_cache=False).logits)


def test_a_chat_fine_tune_with_the_builtin_template_exports_a_tokenizer_that_carries_it(folders, tmp_path, cpu):
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"prompt": f"say {i}", "response": f"{i} {i}"}) + "\n" for i in range(20)))
    w = hf.hf_workload(folders["config"], task="sft", data=[str(chats)], seq_len=64, effective_batch=4, steps=1,
                       warmup_steps=0)
    assert w.info["template"].startswith("builtin")  # the folder's tokenizer has no chat template
    train(w, Plan(micro_batch=4), RunConfig(run_dir=tmp_path / "run", steps=1, progress=False, tensorboard=False),
          hardware=cpu)
    tok = hf.transformers_module().AutoTokenizer.from_pretrained(tmp_path / "run", local_files_only=True)
    chat = [{"role": "user", "content": "say 1"}, {"role": "assistant", "content": "1 1"}]
    assert tok.apply_chat_template(chat, tokenize=False) == "<|user|>\nsay 1\n<|assistant|>\n1 1<|endoftext|>\n"
    prompt = tok.apply_chat_template(chat[:1], tokenize=False, add_generation_prompt=True)
    assert prompt == "<|user|>\nsay 1\n<|assistant|>\n"
    ids = tok.apply_chat_template(chat, tokenize=True, return_dict=False)
    trained, _ = ChatFormat(hf.open_folder(folders["config"]).tokenizer).encode(chat)  # what the model learned
    assert list(ids) == trained.tolist()


def test_the_chunked_loss_of_a_transformers_model_equals_its_own(folders, corpus):
    """plan.loss_chunk for a Transformers causal LM (issue 32): the loss from its last hidden states through the
    chunked linear + cross-entropy, against the model's own logits — the same loss and gradients."""
    w = hf.hf_workload(folders["config"], data=[str(corpus)], seq_len=32, effective_batch=4)
    assert w.loss_chunk_rows is not None and w.loss_chunk_rows >= 64
    batch = tuple(torch.stack(t) for t in zip(*[w.train_data[i] for i in range(4)], strict=True))
    out = []
    for chunk in (None, 24):
        torch.manual_seed(0)
        stepper = Stepper(w, Plan(micro_batch=4, loss_chunk=chunk), torch.device("cpu"), 1e-3, compile=False)
        loss = w.loss_fn(stepper.model, batch)
        loss.backward()
        out.append((loss.detach(), [p.grad.clone() for p in stepper.model.parameters()]))
    (plain, g0), (chunked, g1) = out
    assert torch.allclose(plain, chunked, rtol=1e-5)
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(g0, g1, strict=True))
    model = w.build_model()
    model.config.final_logit_softcapping = 30.0  # logits that are not the plain projection: refused in one line
    with pytest.raises(ConfigError, match="plan.loss_chunk: GPT2LMHeadModel's logits are not .*softcapping"):
        model.set_loss_chunk(64)


def test_a_batch_is_encoded_by_the_fast_backend_as_the_transformers_call_encodes_it(folders):
    transformers = hf.transformers_module()
    tok = transformers.AutoTokenizer.from_pretrained(folders["chat"])
    wrapped = hf.HFTokenizer(tok, folders["chat"])
    texts = ["def f(x):\n    return x\n", "<|endoftext|> and <|user|>hi<|end|>", "", "ünïcode  spaces\t\n"]
    expected = [list(ids) for ids in tok(texts, add_special_tokens=False)["input_ids"]]
    assert [list(a) for a in wrapped.encode_batch(texts)] == expected
    tok.backend_tokenizer.enable_truncation(max_length=3)  # a backend setting the Transformers call switches off
    assert [list(a) for a in wrapped.encode_batch(texts)] == [list(ids) for ids in tok(
        texts, add_special_tokens=False)["input_ids"]] == expected
