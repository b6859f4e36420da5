"""Messages a person reads (issue 16): the `list` verification cell, a broken zoo.json naming its field, a 403 on
pull, hostile zoo.json fields kept out of the generated README's markup."""

import json

import pytest

from oscar_zoo.errors import IntegrityError
from oscar_zoo.hub.zoo import ZooIndex, verification_summary

from .helpers import verify_report


def test_verification_summary_is_what_a_person_reads():
    assert verification_summary(None) == "unverified"
    assert verification_summary(verify_report()) == "✓ +2.1 % PPL, KL 0.012"
    assert verification_summary(verify_report(kl=0.31, ppl_increase=0.12)) == "✗ +12.0 % PPL, KL 0.31"
    tampered = verify_report()
    tampered["methods"][1]["kl"] = 0.5  # `passed` still true: the mark follows the numbers
    assert verification_summary(tampered).startswith("✗")
    assert verification_summary({"passed": True}) == "not a verify report"


def test_list_shows_the_summary(run_cli):
    code, out, err = run_cli("list")
    assert code == 0, err
    assert "✓ +5.1 % PPL, KL 0.052" in out and "ppl_increa" not in out


def test_invalid_zoo_json_names_the_field():
    doc = {"schema_version": 1, "tool": "oscar-zoo", "models": [{"subfolder": "a", "model_id": "m"}]}
    with pytest.raises(IntegrityError) as exc:
        ZooIndex.from_json(json.dumps(doc), source="hf:zoo/r/zoo.json")
    assert "field 'models.0.granularity': Field required" in exc.value.message
    assert "validation error for ZooIndex" not in exc.value.message
