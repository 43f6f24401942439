"""Answer and source-selection metrics equal hand-computed values on fixed examples."""

import math

import pytest

from jaxrag.data.schema import QAExample
from jaxrag.errors import JaxragError
from jaxrag.eval.metrics import (
    auroc,
    dataset_accuracy,
    extract_choice,
    extract_true_false,
    normalize_answer,
    retrieval_preferred,
    score_prediction,
    source_selection_accuracy,
    str_em,
    substring_match,
    token_f1,
    true_false_accuracy,
)
from jaxrag.world.probe import answer_scores, states_answer


@pytest.mark.parametrize("text, expected", [
    ("The  Beatles!", "beatles"),
    ("An apple, a day.", "apple day"),
    ("U.S.A.", "usa"),
    ("Theatre", "theatre"),  # articles only as whole words
])
def test_normalize_answer(text, expected):
    assert normalize_answer(text) == expected


MATCH_CASES = [  # (prediction, golds, expected)
    ("He was a politician.", ["politician", "political leader"], 1.0),
    ("The answer is Andy Warhol", ["andy warhol"], 1.0),
    ("Warhol", ["Andy Warhol"], 0.0),  # the gold must be inside the prediction, not vice versa
    ("It is in the U.S.A.", ["USA"], 1.0),
    ("France", ["Paris"], 0.0),
    ("anything at all", ["The"], 0.0),  # a gold that normalizes to "" matches nothing
    ("", ["Mars"], 0.0),
]


@pytest.mark.parametrize("prediction, golds, expected", MATCH_CASES)
def test_substring_match(prediction, golds, expected):
    assert substring_match(prediction, golds) == expected


TRUE_FALSE_CASES = [  # (prediction, gold, extracted, expected)
    ("true", "true", "true", 1.0),
    ("False. Garlic does not cure flu.", "false", "false", 1.0),
    ("The claim is true, not false.", "false", "true", 0.0),  # the first label word counts
    ("SUPPORTS", "true", "true", 1.0),
    ("REFUTES", "true", "false", 0.0),
    ("It is untrue", "false", None, 0.0),  # whole words only
    ("I am not sure.", "true", None, 0.0),
]


@pytest.mark.parametrize("prediction, gold, extracted, expected", TRUE_FALSE_CASES)
def test_true_false(prediction, gold, extracted, expected):
    assert extract_true_false(prediction) == extracted
    assert true_false_accuracy(prediction, [gold]) == expected


ARC = QAExample("Mercury_1", "Which is a source of heat?", ("the Sun",),
                ("ice", "the Sun", "snow", "heat lamp"),
                {"answer_key": "B", "choice_labels": ["A", "B", "C", "D"]})
NUMERIC = QAExample("NYSED_2", "What do plants need?", ("light",), ("light", "sand", "noise"),
                    {"answer_key": "1", "choice_labels": ["1", "2", "3"]})
CHOICE_CASES = [  # (example, prediction, picked index, expected)
    (ARC, "B", 1, 1.0),
    (ARC, "(B) the Sun", 1, 1.0),
    (ARC, "Answer: B.", 1, 1.0),
    (ARC, "the answer is C", 2, 0.0),
    (ARC, "The Sun gives heat.", 1, 1.0),  # option text
    (ARC, "A heat lamp, not ice.", 3, 0.0),  # "A" + word is an article; first option text wins
    (ARC, "Snow or the sun", 2, 0.0),
    (ARC, "E", None, 0.0),  # no fifth option
    (ARC, "I do not know", None, 0.0),
    (NUMERIC, "1", 0, 1.0),  # ARC's numeric labels
    (NUMERIC, "B)", 1, 0.0),  # letters by position work for numeric labels too
    (NUMERIC, "Plants need light.", 0, 1.0),
]


@pytest.mark.parametrize("example, prediction, picked, expected", CHOICE_CASES)
def test_multiple_choice(example, prediction, picked, expected):
    assert extract_choice(prediction, example.choices,
                          example.metadata["choice_labels"]) == picked
    assert score_prediction("arc_challenge", prediction, example) == expected


def test_longest_option_wins_at_the_same_place():
    assert extract_choice("heat energy is released", ["heat", "heat energy", "light"]) == 1


def test_token_f1_and_str_em():
    # pred {blue, is, primary, colour} vs gold {blue, is, one, of, three, primary, colours}:
    # 3 shared -> P = 3/4, R = 3/7, F1 = 2PR/(P+R) = 6/11
    assert token_f1("Blue is a primary colour", ["Blue is one of the three primary colours."]) \
        == pytest.approx(6 / 11)
    assert token_f1("nothing shared", ["blue"]) == 0.0
    # ASQA: 1 of 2 sub-questions answered
    assert str_em("It was Ben Wright.", [["Ben Wright"], ["Tom Jones", "Tommy Jones"]]) == 0.5


def test_score_prediction_dispatches_on_dataset_or_metric_name():
    popqa = QAExample("1", "Who?", ("Andy Warhol",))
    claim = QAExample("2", "Claim: x. True or false?", ("false",))
    asqa = QAExample("3", "Who?", ("long answer",),
                     metadata={"short_answers": [["Ben"], ["Tom"]]})
    assert score_prediction("popqa", "andy warhol did", popqa) == 1.0
    assert score_prediction("triviaqa", "warhol", popqa) == 0.0
    assert score_prediction("match", "Andy Warhol", popqa) == 1.0
    assert score_prediction("pubhealth", "False.", claim) == 1.0
    assert score_prediction("fever", "REFUTES", claim) == 1.0
    assert score_prediction("asqa", "Ben and Tom", asqa) == 1.0
    assert score_prediction("wow", "a long answer", asqa) == 1.0  # F1: P = R = 1
    with pytest.raises(JaxragError, match="unknown dataset or metric 'squad'"):
        score_prediction("squad", "x", popqa)
    with pytest.raises(JaxragError, match="multiple choice needs"):
        score_prediction("arc_challenge", "A", popqa)


def test_dataset_accuracy_is_the_mean():
    examples = [QAExample(str(i), "q", (g,)) for i, (_, gs, _) in enumerate(MATCH_CASES)
                for g in gs[:1]]
    predictions = [p for p, _, _ in MATCH_CASES]
    assert dataset_accuracy("popqa", predictions, examples) == pytest.approx(3 / 7)
    with pytest.raises(JaxragError):
        dataset_accuracy("popqa", predictions[:2], examples)


def test_source_selection_accuracy_and_auroc():
    verbalized = [1, 0, 1, 0, 0]
    retrieved_scores = [1, 1, 0, 0, 1]
    # retrieval strictly better only on rows 1 and 4 (ties prefer verbalization)
    assert retrieval_preferred(verbalized, retrieved_scores) == [0, 1, 0, 0, 1]
    # Retrieving is right iff ret >= verb, verbalizing iff verb >= ret: a tie is right either way.
    # Row 0 retrieves on a tie (right), 1 retrieves where retrieval wins (right), 2 verbalizes
    # where verbalization wins (right), 3 verbalizes on a tie (right), 4 verbalizes and loses.
    decisions = [True, True, False, False, False]
    assert source_selection_accuracy(decisions, verbalized, retrieved_scores) == 4 / 5
    assert source_selection_accuracy([False] * 5, verbalized, retrieved_scores) == 3 / 5  # wrong on 1, 4
    assert source_selection_accuracy([True] * 5, verbalized, retrieved_scores) == 4 / 5  # wrong on 2
    # positives {0.8, 0.4}, negatives {0.9, 0.3, 0.1}: pairs ranked right = 2 + 2 of 6
    assert auroc([0, 1, 0, 0, 1], [0.9, 0.8, 0.3, 0.1, 0.4]) == pytest.approx(4 / 6)
    assert auroc([1, 0], [0.5, 0.5]) == 0.5  # ties count half
    assert math.isnan(auroc([1, 1], [0.2, 0.7]))  # one class: undefined
    with pytest.raises(JaxragError):
        source_selection_accuracy([True], verbalized, retrieved_scores)


def test_probe_answer_scores_by_hand():
    answers = ["Paris is big", "the Rome", "", "Oslo."]
    golds = ["paris", "Rome", "Bern", "Lima"]
    passages = ["It lies near Paris.", "Nothing here.", "Bern.", "Oslo and Lima are cities."]
    # accuracy: paris, rome (article dropped) = 2/4; first word in passage: paris, oslo = 2/4
    assert answer_scores(answers, golds, passages) == {"accuracy": 0.5, "from_passage": 0.5}
    assert answer_scores(answers, golds) == {"accuracy": 0.5}


def test_probe_states_answer_by_hand():
    docs = ["Kelo was born in New Paris. He is a potter.", "The color of every telli is brown.",
            "Parisville is far away.", ""]
    golds = ["new paris", "Brown", "Paris", "Oslo"]
    # whole normalized words only: "new paris" and "brown" are stated, "paris" is not a word of doc 3
    assert states_answer(docs, golds) == 0.5
