"""TFDS builds as TPU VM users keep them: real TFDS builders prepare the published datasets here,
offline, from files in each builder's download layout (only the download step is replaced), and
jaxrag reads them with `--config.data.paths.NAME=tfds:BUILDER/CONFIG[:split]` and
`data.tfds_data_dir`, without TensorFlow."""

import json

import pytest

from jaxrag.data import loaders
from jaxrag.data.loaders import load_dataset_examples
from jaxrag.errors import JaxragError

import tensorflow_datasets as tfds  # noqa: E402 - a declared dependency: a missing install fails here

NQ_OPEN = [{"question": "who sang hey jude", "answer": ["The Beatles"]},
           {"question": "when was the eiffel tower built", "answer": ["1887", "1889"]}]
ARC = [{"id": "Mercury_7175875", "answerKey": "C", "question": {
    "stem": "An astronomer observes that a planet rotates faster after a meteorite impact. Which is the most "
            "likely effect of this increase in rotation?",
    "choices": [{"text": "Planetary density will decrease.", "label": "A"},
                {"text": "Planetary years will become longer.", "label": "B"},
                {"text": "Planetary days will become shorter.", "label": "C"},
                {"text": "Planetary gravity will become stronger.", "label": "D"}]}},
       {"id": "NYSEDREGENTS_2015_4_27", "answerKey": "1", "question": {
           "stem": "Which tool is used to measure mass?",
           "choices": [{"text": "balance", "label": "1"}, {"text": "ruler", "label": "2"},
                       {"text": "thermometer", "label": "3"}]}}]
OBQA = [{"id": "7-980", "question": {"stem": "The sun is responsible for", "choices": [
    {"text": "puppies learning new tricks", "label": "A"},
    {"text": "children growing up and getting old", "label": "B"},
    {"text": "flowers wilting in a vase", "label": "C"},
    {"text": "plants sprouting, blooming and wilting", "label": "D"}]},
    "fact1": "the sun is the source of energy for physical cycles on Earth", "humanScore": 1.0, "clarity": 2.0,
    "turkIdAnonymized": "b356d338b7", "answerKey": "D"}]
TRIVIA = {"Data": [{
    "Answer": {"Aliases": ["Sunset Blvd", "West Sunset Boulevard", "Sunset Boulevard", "Sunset Bulevard",
                           "Sunset Blvd."],
               "MatchedWikiEntityName": "Sunset Boulevard",
               "NormalizedAliases": ["west sunset boulevard", "sunset blvd", "sunset boulevard", "sunset bulevard"],
               "NormalizedMatchedWikiEntityName": "sunset boulevard", "NormalizedValue": "sunset boulevard",
               "Type": "WikipediaEntity", "Value": "Sunset Boulevard"},
    "EntityPages": [], "Question": "Which Lloyd Webber musical premiered in the US on 10th December 1993?",
    "QuestionId": "tc_33", "QuestionSource": "http://www.triviacountry.com/", "SearchResults": []}],
    "Domain": "Web", "VerifiedEval": False, "Version": 1.0}


def prepare(module, data_dir, config=None, **splits):
    """Runs TFDS's own builder (its features and `_generate_examples`) on the given files: only
    `_split_generators`, which would download, is replaced."""
    real = module.Builder
    with tfds.core.registered.skip_registration():
        class Local(real):
            name = real.name
            pkg_dir_path = real._get_pkg_dir_path()

            def _split_generators(self, dl_manager):
                return [tfds.core.SplitGenerator(name=s, gen_kwargs=kw) for s, kw in splits.items()]

    Local(data_dir=str(data_dir), config=config, file_format="array_record").download_and_prepare()


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    from tensorflow_datasets.datasets.ai2_arc import ai2_arc_dataset_builder as arc
    from tensorflow_datasets.datasets.natural_questions_open import natural_questions_open_dataset_builder as nq
    from tensorflow_datasets.datasets.openbookqa import openbookqa_dataset_builder as obqa
    from tensorflow_datasets.datasets.trivia_qa import trivia_qa_dataset_builder as trivia

    raw, out = tmp_path_factory.mktemp("downloads"), tmp_path_factory.mktemp("tensorflow_datasets")
    (raw / "NQ-open.train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in NQ_OPEN))
    prepare(nq, out, train={"file_path": str(raw / "NQ-open.train.jsonl")})
    (raw / "ARC-Challenge-Test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ARC))
    prepare(arc, out, "ARC-Challenge", test={"filepath": str(raw / "ARC-Challenge-Test.jsonl")})
    (raw / "train_complete.jsonl").write_text("".join(json.dumps(r) + "\n" for r in OBQA))
    prepare(obqa, out, train={"data_dir": str(raw), "filepath": str(raw / "train_complete.jsonl")})
    (raw / "unfiltered-web-dev.json").write_text(json.dumps(TRIVIA, indent=4))  # the release's layout
    prepare(trivia, out, "unfiltered.nocontext",
            validation={"files": [str(raw / "unfiltered-web-dev.json")], "web_dir": None, "wiki_dir": None})
    return str(out)


@pytest.fixture(autouse=True)
def fresh_cache(monkeypatch):
    monkeypatch.setattr(loaders, "_LOADED", {})


def test_natural_questions_open(data_dir):
    examples = load_dataset_examples("nq", "tfds:natural_questions_open", tfds_data_dir=data_dir)
    assert sorted((e.question, e.golden_answers) for e in examples) == [
        ("when was the eiffel tower built", ("1887", "1889")), ("who sang hey jude", ("The Beatles",))]


def test_ai2_arc_class_labels_read_as_the_hub_gives_them(data_dir):
    examples = load_dataset_examples("arc_challenge", "tfds:ai2_arc/ARC-Challenge:test", tfds_data_dir=data_dir)
    by_id = {e.id: e for e in examples}
    mercury, regents = by_id["Mercury_7175875"], by_id["NYSEDREGENTS_2015_4_27"]
    assert (mercury.golden_answers, mercury.metadata["answer_key"]) == (("Planetary days will become shorter.",), "C")
    assert mercury.choices[0] == "Planetary density will decrease."
    # TFDS maps ARC's numeric labels to letters ("1" -> "A") when it builds
    assert (regents.golden_answers, regents.metadata["choice_labels"]) == (("balance",), ["A", "B", "C"])


def test_openbookqa_lettered_choices(data_dir):
    [ex] = load_dataset_examples("obqa", "tfds:openbookqa", tfds_data_dir=data_dir)
    assert ex.question == "The sun is responsible for"
    assert ex.choices == ("puppies learning new tricks", "children growing up and getting old",
                          "flowers wilting in a vase", "plants sprouting, blooming and wilting")
    assert (ex.golden_answers, ex.metadata["answer_key"]) == (("plants sprouting, blooming and wilting",), "D")


def test_trivia_qa_unfiltered_nocontext(data_dir):
    [ex] = load_dataset_examples("triviaqa", "tfds:trivia_qa/unfiltered.nocontext", tfds_data_dir=data_dir)
    assert (ex.id, ex.question) == ("tc_33", "Which Lloyd Webber musical premiered in the US on 10th December 1993?")
    assert ex.golden_answers[:2] == ("Sunset Boulevard", "Sunset Blvd") and "sunset bulevard" in ex.golden_answers


def test_a_config_reads_tfds_builds_and_checks_its_settings(data_dir, tmp_path):
    from jaxrag.data.check import dataset_examples
    from jaxrag.pipeline.config import paper_config
    from jaxrag.pipeline.config_check import tfds_problems  # check_config's TFDS part

    cfg = paper_config("qwen2")
    cfg.data.paths.arc_challenge = "tfds:ai2_arc/ARC-Challenge"  # the paper's split: test
    cfg.data.tfds_data_dir = data_dir
    sources = {"data.paths.arc_challenge": cfg.data.paths.arc_challenge}
    assert tfds_problems(cfg, sources) == []
    assert len(dataset_examples(cfg, "arc_challenge")) == 2
    assert tfds_problems(cfg, {"data.paths.nq": "tfds:nq open"}) == [
        "data.paths.nq='tfds:nq open': expected tfds:BUILDER[/CONFIG][:split], e.g. "
        "tfds:trivia_qa/unfiltered.nocontext:validation"]
    assert tfds_problems(cfg, {}) == [f"data.tfds_data_dir={data_dir} is set, but no data.paths.NAME is a tfds: "
                                      "source; drop it, or point a dataset at tfds:BUILDER/CONFIG[:split]"]
    cfg.data.tfds_data_dir = ""
    assert tfds_problems(cfg, sources) == [
        "data.paths.arc_challenge=tfds:ai2_arc/ARC-Challenge: a TFDS build needs --config.data.tfds_data_dir=DIR "
        "(the folder or bucket holding the builds)"]
    cfg.data.tfds_data_dir = str(tmp_path / "missing")
    assert tfds_problems(cfg, sources) == [f"data.tfds_data_dir={tmp_path / 'missing'}: no such directory"]


def test_a_tfrecord_build_is_refused_with_the_conversion(data_dir, tmp_path):
    import shutil

    # The same build as `tfds build`'s default writes it: dataset_info.json names TFRecord files.
    shutil.copytree(f"{data_dir}/natural_questions_open", tmp_path / "natural_questions_open")
    info_file = tmp_path / "natural_questions_open" / "1.0.0" / "dataset_info.json"
    info_file.write_text(info_file.read_text().replace('"array_record"', '"tfrecord"'))
    with pytest.raises(JaxragError) as info:
        load_dataset_examples("nq", "tfds:natural_questions_open", tfds_data_dir=str(tmp_path))
    assert str(info.value).startswith(f"tfds:natural_questions_open:train ({tmp_path}): the build is in TFRecord "
                                      f"files; jaxrag reads ArrayRecord or Parquet builds (no TensorFlow needed). "
                                      f"Convert it once: tfds convert_format --root_data_dir={tmp_path} ")


def test_missing_builds_and_bad_sources_are_one_line(data_dir):
    with pytest.raises(JaxragError) as info:
        load_dataset_examples("arc_easy", "tfds:ai2_arc/ARC-Easy", tfds_data_dir=data_dir)
    assert str(info.value) == (f"tfds:ai2_arc/ARC-Easy:train ({data_dir}): no build of ai2_arc/ARC-Easy in "
                               f"{data_dir}; build it there with: tfds build ai2_arc/ARC-Easy "
                               f"--data_dir={data_dir} --file_format=array_record")
    with pytest.raises(JaxragError) as info:
        load_dataset_examples("obqa", "tfds:openbookqa:dev", tfds_data_dir=data_dir)
    assert str(info.value) == f"tfds:openbookqa:dev ({data_dir}): the build has no split 'dev' (it has train)"
    with pytest.raises(JaxragError, match=r"^'tfds:': expected tfds:BUILDER\[/CONFIG\]\[:split\]"):
        load_dataset_examples("nq", "tfds:", tfds_data_dir=data_dir)
    with pytest.raises(JaxragError, match="data.tfds_data_dir is empty"):
        load_dataset_examples("nq", "tfds:natural_questions_open")
