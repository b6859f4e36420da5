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
    assert "✓ +1.3 % PPL, KL 0.019" in out and "ppl_increa" not in out


def test_invalid_zoo_json_names_the_field():
    doc = {"schema_version": 1, "tool": "oscar-zoo", "models": [{"subfolder": "a", "model_id": "m"}]}
    with pytest.raises(IntegrityError) as exc:
        ZooIndex.from_json(json.dumps(doc), source="hf:zoo/r/zoo.json")
    assert "field 'models.0.granularity': Field required" in exc.value.message
    assert "validation error for ZooIndex" not in exc.value.message


def test_a_403_on_a_read_says_access_denied_and_on_a_write_no_write_access():
    import httpx2 as httpx
    from huggingface_hub.errors import HfHubHTTPError

    from oscar_zoo.errors import HubError
    from oscar_zoo.hub.huggingface import HuggingFaceHub

    def forbidden():
        response = httpx.Response(403, request=httpx.Request("GET", "http://127.0.0.1/api/models/org/r"))
        return HfHubHTTPError("403 Forbidden", response=response)

    hub = HuggingFaceHub()
    with pytest.raises(HubError) as exc:
        with hub._errors("org/r", call="download of manifest.json"):
            raise forbidden()
    assert "access denied (HTTP 403)" in exc.value.message and "gated or private" in exc.value.message
    assert "write" not in exc.value.message and exc.value.exit_code == 5
    with pytest.raises(HubError) as exc:
        with hub._errors("org/r", committing=True, call="create_commit", writing=True):
            raise forbidden()
    assert "no write access" in exc.value.message


def test_hostile_zoo_fields_stay_text_in_the_readme():
    from oscar_zoo.hub.card import render_zoo_card
    from oscar_zoo.hub.zoo import ZooModel

    hostile = ZooModel(subfolder="a", model_id="x` | <img src=x onerror=alert(1)> | [click](http://evil)",
                       granularity="per-head\n| injected | row |", manifest_sha256="0" * 64,
                       bits_per_element_128k=2.5, verification="**bold** <script>alert(1)</script> | x",
                       updated="2026-01-01T00:00:00+00:00")
    card = render_zoo_card(ZooIndex(models=[hostile]), "zoo/r", "hf").split("---\n", 2)[2]  # the body, not YAML
    (row,) = [line for line in card.splitlines() if line.startswith("| [")]
    assert row.replace("\\|", "").count("|") == 6  # five cells: no `|` of the values splits one
    assert "<img" not in card and "<script>" not in card and "&lt;script&gt;" in card
    assert "[click](http" not in card and "\\*\\*bold\\*\\*" in card
    assert "| injected | row |" not in card  # the newline did not start a row


@pytest.mark.parametrize("subfolder", ["a\\b", "../x", "a/./b", "/abs", "a b"])
def test_backslash_and_escaping_subfolders_in_others_files_are_integrity_errors(subfolder, tmp_path, monkeypatch,
                                                                                run_cli):
    doc = {"schema_version": 1, "tool": "oscar-zoo", "models": [{
        "subfolder": subfolder, "model_id": "m", "granularity": "per-head", "manifest_sha256": "0" * 64,
        "bits_per_element_128k": 2.5, "verification": "unverified", "updated": "t"}]}
    with pytest.raises(IntegrityError) as exc:
        ZooIndex.from_json(json.dumps(doc))
    assert exc.value.exit_code == 4 and "models.0.subfolder" in exc.value.message

    from oscar_zoo.hub.catalog import load_catalog

    (entry,) = load_catalog()
    data = json.loads(entry.to_json())
    data["locations"][0]["subfolder"] = subfolder
    (tmp_path / "cat").mkdir()
    (tmp_path / "cat" / "x.json").write_text(json.dumps(data))
    monkeypatch.setenv("OSCAR_ZOO_CATALOG", str(tmp_path / "cat"))
    code, _, err = run_cli("pull", entry.name, "--dest", tmp_path / "d")
    assert code == 4 and "subfolder" in err and "Traceback" not in err, err
