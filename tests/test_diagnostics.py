"""Interface diagnostics: each figure against a direct computation, on real tiny runs.

Two launched joint runs (2 CPU processes, fp32, ZeRO-2, tiny preset, MLflow in the run's
own SQLite store): VQ-SemFace with its flat codebook split over
2 model-parallel ranks (so the diagnostics read the gathered layer), and CL-SemFace; and an
XLM-style encoder stage without an interface, which the tool must refuse. The direct
computations run one sentence at a time with the model's own modules, so they also
check that batching and padding change nothing.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import sacrebleu
import torch
import torch.nn.functional as F
from launch import ROOT, launch_chains, train_command
from safetensors.torch import save_file

from megasemface.checkpoints import connect_runs, write_seq2seq_dir
from megasemface.cli.diagnose_interface import main as diagnose_main
from megasemface.data.shards.shard_build_config import ShardBuildConfig
from megasemface.data.shards.shard_builder import build_shards
from megasemface.data.text.spm_training import SpmTrainConfig, train_spm
from megasemface.data.text.textio import parse_lang_path
from megasemface.data.text.tokenizer import Tokenizer
from megasemface.distributed.groups import ParallelGroups
from megasemface.evaluation.diagnostics import (
    CodeUsageFigures,
    DiagnosticModels,
    DiagnosticsConfig,
    DiagnosticsError,
    WordCodes,
    code_agreement,
    diagnose_interface,
    load_models,
    word_codes,
)
from megasemface.evaluation.diagnostics.dictionary import whole_word_occurrences
from megasemface.evaluation.diagnostics.reading import unrelated_partners
from megasemface.inference.translate import Translator
from megasemface.interfaces.vq.code_probabilities import code_log_probs
from megasemface.interfaces.vq.gumbel_quantizer import GumbelVectorQuantizer
from megasemface.interfaces.vq.vector_quantized import VectorQuantizedInterface
from megasemface.nn.config import PRESETS, VQConfig

SENTENCES = 24


# Figures on hand-made input ---------------------------------------------------------------


def test_code_usage_by_hand() -> None:
    config = PRESETS["tiny"]()
    config = dataclasses.replace(config, vq=dataclasses.replace(config.vq, num_codes=8))
    vq = VectorQuantizedInterface(config, ParallelGroups.single(), seed=0)

    def code_usage(codes: list[int]) -> CodeUsageFigures:
        return CodeUsageFigures.of(vq.code_figures(torch.tensor(codes)))

    usage = code_usage([5, 5, 1, 7, 5, 1])
    assert (usage.tokens, usage.used, usage.dead, usage.fraction) == (6, 3, 5, 3 / 8)
    p = [3 / 6, 2 / 6, 1 / 6]
    assert usage.perplexity == pytest.approx(math.exp(-sum(x * math.log(x) for x in p)))
    assert code_usage([2, 2, 2]).perplexity == pytest.approx(1.0)


def test_code_agreement_by_hand() -> None:
    def w(argmax: int, *top: int) -> WordCodes:
        return WordCodes(argmax, top, 1)

    source = {"cat": w(1, 1, 2, 3, 4), "dog": w(5, 5, 6, 7, 8)}
    target = {"Katze": w(1, 1, 2, 9, 10), "Hund": w(6, 6, 5, 7, 11), "Haus": w(1, 1, 12, 13, 14)}
    pairs = [("cat", "Katze"), ("dog", "Hund")]
    result = code_agreement(source, target, pairs, k=4)
    assert result.pairs == 2
    assert result.same_code == 0.5  # cat-Katze share code 1, dog-Hund do not
    assert result.overlap == pytest.approx((2 + 3) / 2 / 4)  # {1, 2} and {5, 6, 7}
    # The baseline: the 4 pairings that are no translation, written out.
    others = [("cat", "Hund"), ("cat", "Haus"), ("dog", "Katze"), ("dog", "Haus")]
    same = [source[s].argmax == target[t].argmax for s, t in others]
    shared = [len(set(source[s].top) & set(target[t].top)) for s, t in others]
    assert result.baseline_pairs == 4
    assert result.baseline_same_code == pytest.approx(sum(same) / 4)  # cat-Haus: code 1
    assert result.baseline_overlap == pytest.approx(sum(shared) / 4 / 4)  # 0, 1, 0, 0
    with pytest.raises(ValueError):
        code_agreement(source, target, [], k=4)


def test_word_codes_average_the_occurrences_probabilities() -> None:
    probs = torch.tensor([[0.6, 0.3, 0.1, 0.0], [0.0, 0.5, 0.2, 0.3]])
    codes = word_codes(probs.clamp(min=1e-30).log(), k=2)
    assert (codes.argmax, codes.top, codes.occurrences) == (1, (1, 0), 2)  # mean .3 .4 .15 .15


def direct_code_logits(layer: GumbelVectorQuantizer, h: torch.Tensor) -> torch.Tensor:
    """The layer's noise-free logits written out: Linear-ReLU-Linear, or minus the squared
    distance to each code over sqrt(width), per group (the default)."""
    if layer.hidden is not None:
        return F.linear(F.relu(layer.hidden(h)), layer.logits_weight, layer.logits_bias)
    table = layer.codebook if layer.layout == "product" else layer.codebook[None]
    parts = h.view(h.shape[0], table.shape[0], 1, table.shape[-1])
    return (-(parts - table).square().sum(-1) / table.shape[-1] ** 0.5).flatten(1)


@pytest.mark.parametrize("logits", ["mlp", "distance"])
@pytest.mark.parametrize("layout", ["flat", "product"])
def test_code_log_probs_are_the_layers_distribution(layout: str, logits: str) -> None:
    vq = VQConfig(layout=layout, num_codes=40, groups=2, entries=5, hidden_dim=16, logits=logits)
    layer = GumbelVectorQuantizer(vq, 8, ParallelGroups.single(), seed=3).eval()
    h = torch.randn(30, 8, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        log_probs = code_log_probs(layer, h)
        assert log_probs.shape == (30, vq.combinations)
        torch.testing.assert_close(log_probs.exp().sum(-1), torch.ones(30))
        assert torch.equal(log_probs.argmax(-1), layer(h, sample=False).codes)
        expected = direct_code_logits(layer, h)
        if layout == "flat":
            torch.testing.assert_close(log_probs, expected.log_softmax(-1))
        else:  # code 3 * 5 + 2: entry 3 of group 0, entry 2 of group 1
            groups = expected.view(30, 2, 5).log_softmax(-1)
            torch.testing.assert_close(log_probs[:, 17], groups[:, 0, 3] + groups[:, 1, 2])


def test_occurrences_are_whole_words_in_text_order() -> None:
    # Pieces: 10 "▁Delete", 11 "d" (continues the word), 12 "," and 13 "▁file".
    continues = [False] * 14
    continues[11] = True
    forms = {10: [(10,)], 13: [(13,)]}
    ids = [[10, 11, 13], [13, 10, 12], [10], [10, 13]]
    found = whole_word_occurrences(ids, forms, continues, cap=2)
    assert found == {(13,): [(0, 2), (1, 0)], (10,): [(1, 1), (2, 0)]}


# Real runs -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory, demo_corpus: Path, spm_model: Path) -> dict:
    root = tmp_path_factory.mktemp("diag-data")
    inputs = [f"{lang}:{demo_corpus / 'mono' / f'{lang}.txt'}" for lang in ("en", "de")]
    config = ShardBuildConfig(tokens_per_sample=4096, samples_per_shard=4)
    build_shards(parse_lang_path(inputs), spm_model, root / "shards", config)
    table = torch.randn(
        Tokenizer.load(spm_model).vocab_size, 64, generator=torch.Generator().manual_seed(0)
    )
    save_file({"embeddings": table * 0.3}, str(root / "cl.safetensors"))
    test = demo_corpus / "parallel" / "en-de"
    return {
        "shards": root / "shards",
        "spm": spm_model,
        "cl": root / "cl.safetensors",
        "texts": {"en": test / "test.en", "de": test / "test.de"},
        "dictionary": demo_corpus / "dict" / "en-de.tsv",
        "dir": root,
    }


# name: (steps, arguments)
RUNS: dict[str, tuple[int, tuple[str, ...]]] = {
    # The paper's extractor, so that its codes are reported (the default reads the encoder's).
    "vq": (
        3,
        ("--stage", "joint", "--interface", "vq", "--mp-size", "2", "--decoder-codes", "extractor"),
    ),
    "cl": (3, ("--stage", "joint", "--interface", "cl")),
    "xlm": (2, ("--stage", "encoder", "--interface", "none", "--no-tracking")),
}


@pytest.fixture(scope="module")
def runs(data: dict) -> dict[str, Path]:
    """The three runs in two launches side by side (tests/launch.py's ``chain``): the VQ run,
    whose ranks form a model-parallel group, in one, the others after each other."""
    config = ROOT / "ds_configs" / "cpu_fp32_zero2.json"

    def command(name: str) -> list[str]:
        steps, args = RUNS[name]
        cl = ["--cl-table", str(data["cl"])] if name == "cl" else []
        out = data["dir"] / name
        return train_command(data, out, "--steps", str(steps), *args, *cl, config=config, live=True)

    launch_chains(
        [["vq"], ["cl", "xlm"]], command, lambda name: (data["dir"] / name, RUNS[name][0])
    )
    return {name: data["dir"] / name for name in RUNS}


@pytest.fixture(scope="module")
def vq_run(runs: dict[str, Path]) -> Path:
    return runs["vq"]


@pytest.fixture(scope="module")
def cl_run(runs: dict[str, Path]) -> Path:
    return runs["cl"]


def _config(data: dict, **options: object) -> DiagnosticsConfig:
    return DiagnosticsConfig(texts=data["texts"], max_sentences=SENTENCES, **options)  # type: ignore[arg-type]


def _sentences(path: Path, models: DiagnosticModels) -> list[list[int]]:
    lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return models.tokenizer.encode(lines[:SENTENCES])


def _direct(models: DiagnosticModels, lang: str, ids: list[list[int]]) -> dict:
    """Every figure of one language, sentence by sentence, from the modules themselves."""
    sp, interface, encoder, decoder = (
        models.special,
        models.interface,
        models.encoder,
        models.decoder,
    )
    assert interface is not None and encoder is not None and decoder is not None
    index = models.tokenizer.languages.index(lang)
    langs = torch.tensor([index])
    enc_codes: list[torch.Tensor] = []
    ext_codes: list[torch.Tensor] = []
    cosines: list[torch.Tensor] = []
    nll = {"interface": 0.0, "encoder": 0.0, "zeros": 0.0}
    if models.interface_kind == "vq":
        nll["bridge"] = nll["codes"] = 0.0
    count = same = 0

    def code_logits(h: torch.Tensor) -> torch.Tensor:  # Eq. 5 without noise
        return direct_code_logits(interface.quantizer, h)

    def argmax_codes(h: torch.Tensor) -> torch.Tensor:
        return code_logits(h).argmax(-1)

    with torch.no_grad():
        for sentence in ids:
            n = len(sentence)
            x, ones = torch.tensor([sentence]), torch.ones(1, n, dtype=torch.bool)
            src, src_mask = torch.tensor([[*sentence, sp.eos]]), torch.ones(1, n + 1, dtype=bool)
            encoded = encoder(src, src_mask, langs)
            h = encoded.hidden_BTD[0, :n]
            if models.interface_kind == "vq":
                codebook = interface.quantizer.codebook
                codes = argmax_codes(h)
                enc_codes.append(codes)
                cosines.append(F.cosine_similarity(h, codebook[codes], dim=-1))
                extracted = argmax_codes(interface.extractor(x, ones, langs).hidden_BTD[0])
                ext_codes.append(extracted)
                same += int((extracted == codes).sum())
                own = codebook[extracted]
            else:
                own = interface.table[x[0]]
                cosines.append(F.cosine_similarity(encoded.pre_norm_BTD[0, :n], own, dim=-1))
                if models.memory_norm:  # the joint CL stage's decoder reads LN(E(x))
                    norm = encoder.final_norm
                    own = F.layer_norm(own, norm.normalized_shape, norm.weight, norm.bias, norm.eps)
            memories = {
                "interface": (own[None], ones),
                "encoder": (encoded.hidden_BTD, src_mask),
                "zeros": (torch.zeros(1, n, models.config.d_model), ones),
            }
            if models.interface_kind == "vq":  # every position, </s> too, as connected
                mixture = torch.softmax(code_logits(encoded.hidden_BTD[0]), -1)  # temperature 1
                memories["bridge"] = ((mixture @ interface.quantizer.codebook)[None], src_mask)
                chosen = interface.quantizer.codebook[argmax_codes(encoded.hidden_BTD[0])]
                memories["codes"] = (chosen[None], src_mask)
            inputs = torch.tensor([[sp.lang_tags[index], *sentence]])
            targets = torch.tensor([*sentence, sp.eos])
            for name, (memory, mask) in memories.items():
                hidden = decoder(inputs, torch.ones_like(inputs, dtype=bool), langs, memory, mask)
                logits = decoder.logits(hidden[0])
                nll[name] += float(F.cross_entropy(logits, targets, reduction="sum"))
            count += n + 1
    out: dict = {
        "cosine": float(torch.cat(cosines).mean()),
        "nll": {name: value / count for name, value in nll.items()},
        "nll_tokens": count,
    }
    if ext_codes:
        out["code_agreement"] = same / sum(len(s) for s in ids)
    for name, codes in (("encoder_codes", enc_codes), ("extractor_codes", ext_codes)):
        if codes:
            counts = torch.bincount(torch.cat(codes), minlength=models.num_codes or 0).double()
            p = counts[counts > 0] / counts.sum()
            out[name] = {
                "used": int((counts > 0).sum()),
                "dead": int((counts == 0).sum()),
                "perplexity": math.exp(float(-(p * p.log()).sum())),
            }
    return out


def _check_against_direct(models: DiagnosticModels, result_dict: dict, data: dict) -> None:
    for figures in result_dict["languages"]:
        lang = figures["lang"]
        ids = _sentences(data["texts"][lang], models)
        direct = _direct(models, lang, ids)
        assert figures["sentences"] == len(ids) == SENTENCES
        assert figures["tokens"] == sum(len(s) for s in ids)
        assert figures["cosine"] == pytest.approx(direct["cosine"], abs=1e-5)
        assert figures["nll_tokens"] == direct["nll_tokens"]
        assert figures["code_agreement"] == pytest.approx(direct.get("code_agreement"))
        for memory, value in direct["nll"].items():
            assert figures["nll"][memory] == pytest.approx(value, rel=1e-5), memory
        for name in ("encoder_codes", "extractor_codes"):
            if name in direct:
                ours = figures[name]
                assert (ours["used"], ours["dead"]) == (direct[name]["used"], direct[name]["dead"])
                assert ours["perplexity"] == pytest.approx(direct[name]["perplexity"])


@pytest.mark.launcher
def test_vq_figures_equal_the_direct_computation(vq_run: Path, data: dict) -> None:
    models = load_models(vq_run)
    assert models.num_codes == 512 and models.step == 3 and models.interface_kind == "vq"
    result = diagnose_interface(_config(data, dictionary=data["dictionary"]), models)
    assert result.measures == ["usage", "cosine", "nll", "dictionary"]
    assert result.notes == []
    _check_against_direct(models, result.to_dict(), data)
    # The same call again gives the same figures, to the last bit.
    again = diagnose_interface(_config(data, dictionary=data["dictionary"]), models)
    assert again.to_dict() == result.to_dict()
    dictionary = result.dictionary
    assert dictionary is not None and dictionary.agreement is not None
    assert (dictionary.source_lang, dictionary.target_lang) == ("en", "de")
    agreement = dictionary.agreement
    assert agreement.pairs >= 1 and agreement.k == 100
    assert 0 <= agreement.same_code <= 1 and 0 <= agreement.overlap <= 1


@pytest.mark.launcher
def test_a_decoder_pretrained_on_the_encoders_codes_reads_them_as_its_interface(
    vq_run: Path, data: dict
) -> None:
    """A run with --decoder-codes encoder: its interface memory is the encoder's own codes,
    and its (unused) extractor's codes are not reported."""
    models = dataclasses.replace(load_models(vq_run), decoder_codes="encoder")
    result = diagnose_interface(_config(data), models)
    for figures in result.languages:
        assert figures.nll["interface"] == figures.nll["codes"]
        assert figures.extractor_codes is None and figures.code_agreement is None
        assert figures.encoder_codes is not None


@pytest.mark.launcher
def test_cl_figures_equal_the_direct_computation(cl_run: Path, data: dict) -> None:
    models = load_models(cl_run)
    assert models.memory_norm  # the joint CL stage's default: its decoder read LN(E(x))
    result = diagnose_interface(_config(data), models)
    assert result.measures == ["cosine", "nll"]
    assert all(x.encoder_codes is None for x in result.languages)
    _check_against_direct(models, result.to_dict(), data)


@pytest.mark.launcher
def test_a_cl_decoder_pretrained_on_the_encoders_output_reads_it_as_its_interface(
    cl_run: Path, data: dict
) -> None:
    """A CL run with --decoder-codes encoder(-trained) read the encoder's own output at every
    token (--decoder-continuous 1, or 0 as recorded before a share could be set for CL): that
    is its interface memory. At a share below 1 it read
    the table's rows of the sentence's tokens too: those are its interface memory, as in a
    run on the rows alone, with the row of the </s> the encoder reads after them."""
    run = load_models(cl_run)
    config = _config(data, measures=("nll",))
    table = diagnose_interface(config, run)
    output = dataclasses.replace(run, decoder_codes="encoder-trained", decoder_continuous=1.0)
    recorded_before = dataclasses.replace(output, decoder_continuous=0.0)
    mixed = dataclasses.replace(output, decoder_continuous=0.5)
    for kind, models in (("output", output), ("output", recorded_before), ("mixed", mixed)):
        result = diagnose_interface(config, models)
        for figures, from_table in zip(result.languages, table.languages, strict=True):
            assert figures.nll["encoder"] == from_table.nll["encoder"]
            if kind == "output":
                assert figures.nll["interface"] == figures.nll["encoder"]
            else:
                assert figures.nll["interface"] != figures.nll["encoder"]
                assert figures.nll["interface"] == pytest.approx(
                    from_table.nll["interface"], abs=0.1
                ), (kind, figures.nll, from_table.nll)


@pytest.mark.launcher
def test_connected_model_dir_gives_the_encoder_memory(vq_run: Path, data: dict) -> None:
    model_dir = data["dir"] / "vq-connected"
    write_seq2seq_dir(model_dir, connect_runs(vq_run, vq_run), spm_model=data["spm"])
    joint = diagnose_interface(_config(data, measures=("nll",)), load_models(vq_run))
    both = diagnose_interface(_config(data, measures=("nll",)), load_models(vq_run, model_dir))
    # connect takes the joint run's own encoder and decoder: the same memories, the same NLL.
    assert [x.nll for x in both.languages] == [x.nll for x in joint.languages]
    alone = diagnose_interface(_config(data), load_models(None, model_dir))
    assert alone.measures == ["nll"] and alone.interface is None
    assert [x.nll for x in alone.languages] == [
        {k: v for k, v in x.nll.items() if k not in ("interface", "codes", "bridge")}
        for x in joint.languages
    ]
    assert any("interface memory" in note for note in alone.notes)
    # Connected through the codebook, the model's memory is the stage's bridged encoder output.
    bridged_dir = data["dir"] / "vq-bridged"
    bridged = connect_runs(vq_run, vq_run, bridge="codebook")
    write_seq2seq_dir(bridged_dir, bridged, spm_model=data["spm"])
    through = diagnose_interface(_config(data), load_models(None, bridged_dir))
    for ours, theirs in zip(through.languages, joint.languages, strict=True):
        assert ours.nll["encoder"] == pytest.approx(theirs.nll["bridge"], rel=1e-6)


@pytest.mark.launcher
def test_cli_prints_writes_json_and_logs_to_the_run(
    vq_run: Path, data: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from mlflow.tracking import MlflowClient

    out = tmp_path / "diag.json"
    texts = [a for lang, path in data["texts"].items() for a in ("--text", f"{lang}:{path}")]
    args = ["--checkpoint", str(vq_run), *texts, "--max-sentences", str(SENTENCES)]
    assert diagnose_main([*args, "--output", str(out), "--log-to-run", str(vq_run)]) == 0
    printed = capsys.readouterr().out
    print(printed)  # shown with -s: the table the docs quote
    assert "encoder codes used (of 512)" in printed and "NLL/token, zero memory" in printed
    written = json.loads(out.read_text())
    meta = json.loads((vq_run / "checkpoints" / "step-00000003" / "meta.json").read_text())
    client = MlflowClient(f"sqlite:///{vq_run / 'mlflow.db'}")
    logged = client.get_run(meta["mlflow_run_id"]).data.metrics
    assert {k: v for k, v in logged.items() if k.startswith("diag_")} == written["metrics"]
    history = client.get_metric_history(meta["mlflow_run_id"], "diag_en_nll_zeros")
    assert [m.step for m in history] == [3]
    assert written["metrics"]["diag_en_nll_zeros"] == written["languages"][0]["nll"]["zeros"]


@pytest.mark.launcher
def test_cli_refuses_bad_input_with_one_line(
    runs: dict[str, Path],
    vq_run: Path,
    cl_run: Path,
    data: dict,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    en = f"en:{data['texts']['en']}"
    xlm_run = runs["xlm"]
    other = tmp_path / "other"
    corpora = parse_lang_path([f"en:{data['texts']['en']}", f"de:{data['texts']['de']}"])
    train_spm(corpora, other, SpmTrainConfig(vocab_size=600, num_threads=1, seed=1))
    cases = {
        "no such file": ["--checkpoint", str(vq_run), "--text", f"en:{tmp_path / 'none.en'}"],
        "does not exist": ["--checkpoint", str(tmp_path / "no-run"), "--text", en],
        "not the SentencePiece model": [
            *("--checkpoint", str(vq_run), "--text", en),
            *("--spm-model", str(other.with_suffix(".model"))),
        ],
        "'cl' interface: code usage needs VQ codes": [
            *("--checkpoint", str(cl_run), "--text", en, "--measure", "usage"),
        ],
        "'none' interface: code usage needs VQ codes": [
            *("--checkpoint", str(xlm_run), "--text", en, "--measure", "usage"),
        ],
        "nothing to measure": ["--checkpoint", str(xlm_run), "--text", en],
        "records no MLflow run": [
            *("--checkpoint", str(xlm_run), "--text", en, "--measure", "cosine"),
            *("--log-to-run", str(vq_run)),
        ],
        "the dictionary analysis needs VQ codes": [
            *("--checkpoint", str(cl_run), "--text", en),
            *("--dictionary", str(data["dictionary"])),
        ],
        "not in the SentencePiece model": ["--checkpoint", str(vq_run), "--text", f"fr:{en[3:]}"],
        "not in sqlite": [
            *("--checkpoint", str(vq_run), "--text", en),
            *("--log-to-run", f"sqlite:///{cl_run / 'mlflow.db'}"),
        ],
    }
    for expected, args in cases.items():
        assert diagnose_main(args) == 2, expected
        captured = capsys.readouterr()
        assert expected in captured.err and captured.err.count("\n") == 1, captured.err
        assert "Traceback" not in captured.err and captured.out == ""
    with pytest.raises(DiagnosticsError, match="pass --checkpoint, --model-dir or both"):
        load_models(None)


# Reading a translation ----------------------------------------------------------------------


def test_unrelated_partner_is_another_sentence_of_the_nearest_length() -> None:
    lengths = [5, 3, 5, 9, 3, 4]
    partners = unrelated_partners(lengths)
    # Order by (length, index): 1, 4, 5, 0, 2, 3; each takes the nearer neighbour, the next
    # one on a tie (5: 4 and 0 both one token away).
    assert partners == [2, 4, 0, 2, 1, 0]
    for i, j in enumerate(partners):
        others = [abs(lengths[k] - lengths[i]) for k in range(len(lengths)) if k != i]
        assert j != i and abs(lengths[j] - lengths[i]) == min(others)
    with pytest.raises(ValueError, match="at least 2"):
        unrelated_partners([4])


def _direct_reading(models: DiagnosticModels, src_lang: str, tgt_lang: str, data: dict) -> dict:
    """The reading figures of one direction, pair by pair, from the modules themselves."""
    assert models.decoder is not None and models.seq2seq is not None
    sp, langs = models.special, models.tokenizer.languages
    src_ids = _sentences(data["texts"][src_lang], models)
    tgt_ids = _sentences(data["texts"][tgt_lang], models)
    src_index, tgt_index = langs.index(src_lang), langs.index(tgt_lang)
    nll = {"translation": 0.0, "unrelated": 0.0, "zeros": 0.0, "recentred": 0.0}
    count = 0
    hypotheses = []
    translator = Translator(models.seq2seq, models.tokenizer)

    def mean_output(sentences: list[list[int]], lang_index: int) -> torch.Tensor:
        """The encoder's mean output over every position of the sentences, one at a time."""
        outputs = [
            models.seq2seq.encode(  # type: ignore[union-attr]
                torch.tensor([[*s, sp.eos]]),
                torch.ones(1, len(s) + 1, dtype=torch.bool),
                torch.tensor([lang_index]),
            ).hidden_BTD[0]
            for s in sentences
        ]
        return torch.cat(outputs).mean(dim=0)

    with torch.no_grad():
        shift = mean_output(tgt_ids, tgt_index) - mean_output(src_ids, src_index)
        for i, (source, target) in enumerate(zip(src_ids, tgt_ids, strict=True)):
            # the unrelated sentence: the other one nearest in length (of the two neighbours in
            # the order of length and index, the next one on a tie)
            order = sorted(range(len(src_ids)), key=lambda k: (len(src_ids[k]), k))
            rank = order.index(i)
            near = [order[r] for r in (rank + 1, rank - 1) if 0 <= r < len(order)]
            other = src_ids[min(near, key=lambda k: abs(len(src_ids[k]) - len(source)))]

            def encoded(sentence: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
                src = torch.tensor([[*sentence, sp.eos]])
                out = models.seq2seq.encode(
                    src, torch.ones_like(src, dtype=bool), torch.tensor([src_index])
                )  # type: ignore[union-attr]
                return out.hidden_BTD, torch.ones_like(src, dtype=bool)

            memories = {
                "translation": encoded(source),
                "unrelated": encoded(other),
                "zeros": (torch.zeros(1, 1, models.config.d_model), torch.ones(1, 1, dtype=bool)),
            }
            memories["recentred"] = (memories["translation"][0] + shift, memories["translation"][1])
            inputs = torch.tensor([[sp.lang_tags[tgt_index], *target]])
            targets = torch.tensor([*target, sp.eos])
            tgt_langs = torch.tensor([tgt_index])
            for name, (memory, mask) in memories.items():
                ones = torch.ones_like(inputs, dtype=bool)
                hidden = models.decoder(inputs, ones, tgt_langs, memory, mask)
                logits = models.decoder.logits(hidden[0])
                nll[name] += float(F.cross_entropy(logits, targets, reduction="sum"))
            count += len(target) + 1
            greedy = translator.translate_ids([source], src_lang=src_lang, tgt_lang=tgt_lang)
            hypotheses.append(models.tokenizer.decode(greedy[0].tokens))
    lines = data["texts"][tgt_lang].read_text(encoding="utf-8").splitlines()
    references = [line for line in lines if line.strip()][:SENTENCES]
    bleu = sacrebleu.corpus_bleu(hypotheses, [references]).score
    return {"nll": {k: v / count for k, v in nll.items()}, "tokens": count, "bleu": bleu}


@pytest.mark.launcher
def test_reading_a_translation_equals_the_direct_computation(
    cl_run: Path, data: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model_dir = tmp_path / "cl-connected"
    write_seq2seq_dir(model_dir, connect_runs(cl_run, cl_run), spm_model=data["spm"])
    models = load_models(cl_run, model_dir)
    config = _config(data, measures=("translation",), translations=("en", "de"))
    result = diagnose_interface(config, models)
    assert [(x.source_lang, x.target_lang) for x in result.reading] == [("en", "de"), ("de", "en")]
    for reading in result.reading:
        direct = _direct_reading(models, reading.source_lang, reading.target_lang, data)
        assert reading.pairs == SENTENCES and reading.tokens == direct["tokens"]
        for memory, value in direct["nll"].items():
            assert reading.nll[memory] == pytest.approx(value, rel=1e-5), memory
        assert reading.bleu == pytest.approx(direct["bleu"])
        assert reading.gain_over_zeros == reading.nll["zeros"] - reading.nll["translation"]
        recentred = reading.nll["zeros"] - reading.nll["recentred"]
        assert reading.recentred_gain_over_zeros == recentred
    metrics = result.metrics()
    assert metrics["diag_read_de_en_nll_unrelated"] == result.reading[1].nll["unrelated"]
    assert metrics["diag_read_en_de_zero_shot_bleu"] == result.reading[0].bleu
    assert metrics["diag_read_en_de_nll_recentred"] == result.reading[0].nll["recentred"]
    assert metrics["diag_read_de_en_recentred_gain_over_zeros"] == recentred
    # Any connected model: the model directory alone (mBART's, XLM's) gives the same figures.
    alone = diagnose_interface(config, load_models(None, model_dir))
    assert [x.to_dict() for x in alone.reading] == [x.to_dict() for x in result.reading]
    # The tool: --translations, and one line for texts that are not line-aligned.
    texts = [a for lang, path in data["texts"].items() for a in ("--text", f"{lang}:{path}")]
    args = ["--model-dir", str(model_dir), *texts, "--max-sentences", str(SENTENCES)]
    assert diagnose_main([*args, "--translations", "en-de"]) == 0
    assert "en-de (24 pairs)" in capsys.readouterr().out
    short = tmp_path / "short.de"
    short.write_text(
        "".join(line + "\n" for line in data["texts"]["de"].read_text().splitlines()[:5])
    )
    bad = ["--model-dir", str(model_dir), "--text", f"en:{data['texts']['en']}"]
    assert diagnose_main([*bad, "--text", f"de:{short}", "--translations", "en-de"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "line-aligned" in err[0]
