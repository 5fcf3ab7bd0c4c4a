"""Label masking around the scanner: existing -100s, pad, plain text, warnings, overrides."""

from __future__ import annotations

import io
import logging
import warnings

import pytest
import torch
from _tokenizers import load_tokenizer
from test_real_templates import CHAT, render, trained_spans

from autooffload import log
from autooffload.errors import SettingsError
from autooffload.masking import IGNORE_INDEX, MaskerCache, MaskingOptions, explain


def qwen_masker(**options):
    return MaskerCache(MaskingOptions(**options)).get(load_tokenizer("qwen3"))


def test_labels_already_masked_stay_masked():
    ids = torch.tensor(render("qwen3", CHAT))
    labels = ids.clone()
    labels[-6:] = IGNORE_INDEX  # the caller masked the end of the last answer
    masked = qwen_masker().mask(ids, labels)
    assert bool((masked[-6:] == IGNORE_INDEX).all())
    assert (masked != IGNORE_INDEX).sum() == (qwen_masker().mask(ids) != IGNORE_INDEX).sum() - 5


def test_plain_text_and_foreign_labels_are_untouched():
    tokenizer = load_tokenizer("qwen3")
    plain = torch.tensor([tokenizer.encode("Once upon a time there was a dog.")])
    labels = plain.clone()
    assert qwen_masker().mask(plain, labels) is labels
    chat = torch.tensor([render("qwen3", CHAT)])
    shifted = torch.roll(chat, -1, dims=1)  # pre-shifted labels are not ours to touch
    assert torch.equal(qwen_masker().mask(chat, shifted), shifted)


def test_pad_equal_to_eos_without_attention_mask():
    tokenizer = load_tokenizer("llama3.1")
    eot = tokenizer.eos_token_id
    sample = render("llama3.1", CHAT)
    ids = torch.tensor([sample + [eot] * 5])
    masker = MaskerCache(MaskingOptions()).get(tokenizer)
    masker.pad_token_id = eot  # users set pad = eos for Llama 3
    masked = masker.mask(ids)
    assert bool((masked[0, -5:] == IGNORE_INDEX).all())
    assert trained_spans(tokenizer, ids[0], masked[0])[-1] == "It is 6.<|eot_id|>"


def test_all_masked_samples_warn_once_with_count():
    log.reset_warnings()
    masker = qwen_masker(roles_to_train=())
    ids = torch.tensor([render("qwen3", CHAT)] * 3)
    with pytest.warns(UserWarning, match="3 of 3 chat samples"):
        masker.mask(ids)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        masker.mask(ids)
    assert (masker.stats.samples, masker.stats.all_masked) == (6, 6)


def test_unknown_template_warns_once_and_masks_nothing():
    log.reset_warnings()
    tokenizer = load_tokenizer("qwen3")

    class Custom:  # a tokenizer with a template of no known family and no known specials
        chat_template = "{{ messages }}"
        name_or_path = "custom"

        def convert_tokens_to_ids(self, token):
            return None

    with pytest.warns(UserWarning, match="unknown chat template"):
        assert MaskerCache(MaskingOptions()).get(Custom()) is None
    assert MaskerCache(MaskingOptions()).get(tokenizer) is not None


def test_detecting_a_template_logs_nothing_at_info():
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    logger = logging.getLogger("autooffload")
    logger.addHandler(handler)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    try:
        cache = MaskerCache(MaskingOptions(roles_to_train=("assistant",), train_on_eos="turn"))
        cache.get(load_tokenizer("qwen3"))
        cache.get(load_tokenizer("qwen3"))
        cache.get(load_tokenizer("llama3.1"))
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    assert stream.getvalue() == ""  # the INFO line comes with the first batch masking changes


@pytest.mark.parametrize(
    ("marker", "message"),
    [("   ", "blank"), ([], "non-empty"), ([-1], "non-empty")],
)
def test_role_boundaries_checked_without_tokenizer(marker, message):
    boundaries = [
        {
            "role": "assistant",
            "start": marker,
            "end": None,
            "include_start": False,
            "include_end": True,
        },
    ]
    with pytest.raises(SettingsError, match=rf"role_boundaries\[0\]\.start.*{message}"):
        MaskerCache(MaskingOptions(), boundaries)


def test_role_boundaries_checked_with_tokenizer():
    boundaries = [
        {
            "role": "assistant",
            "start": [10**7],
            "end": "<|im_end|>",
            "include_start": False,
            "include_end": True,
        },
    ]
    with pytest.raises(SettingsError, match=r"role_boundaries\[0\]\.start.*outside the vocab"):
        MaskerCache(MaskingOptions(), boundaries).get(load_tokenizer("qwen3"))


def test_generation_mask_agrees_on_patched_qwen3_template():
    """No real template here has {% generation %}: a copy of Qwen3's gets it around contents."""
    tokenizer = load_tokenizer("qwen3")
    template = tokenizer.chat_template
    plain = "{{- '<|im_start|>' + message.role + '\\n' + content }}"
    think = (
        "{{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n')"
        " + '\\n</think>\\n\\n' + content.lstrip('\\n') }}"
    )
    assert plain in template and think in template
    patched = template.replace(
        plain,
        "{{- '<|im_start|>' + message.role + '\\n' }}{% generation %}{{- content }}"
        "{% endgeneration %}",
    ).replace(
        think,
        "{{- '<|im_start|>' + message.role + '\\n' }}{% generation %}{{- '<think>\\n' + "
        "reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}"
        "{% endgeneration %}",
    )
    out = tokenizer.apply_chat_template(
        CHAT,
        chat_template=patched,
        tokenize=True,
        return_dict=True,
        return_assistant_tokens_mask=True,
    )
    ids = torch.tensor(out["input_ids"])
    generation = torch.tensor(out["assistant_masks"])
    masker = qwen_masker()
    log.reset_warnings()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        agreed = masker.mask(ids, assistant_mask=generation)
    assert torch.equal(agreed, masker.mask(ids))
    with pytest.warns(UserWarning, match="chatml chat template's .* generation"):
        used = masker.mask(ids, assistant_mask=torch.roll(generation, 1))
    assert not torch.equal(used, agreed)  # the template's mask is what gets used


@pytest.mark.parametrize(("name", "end"), [("qwen3", "<|im_end|>"), ("gemma3", "<end_of_turn>")])
def test_trl_training_templates_agree_and_train_no_newline_after_the_turn(name, end):
    """TRL's training templates put the newline after the end marker inside
    ``{% generation %}``: that newline lies between turns, so it is no disagreement and is not
    trained; the template's mask gives the scanner's labels."""
    pytest.importorskip("trl")
    from importlib.resources import files

    source = files("trl") / "chat_templates" / f"{name}_training.jinja"
    tokenizer = load_tokenizer(name)
    out = tokenizer.apply_chat_template(
        CHAT,
        chat_template=source.read_text(),
        tokenize=True,
        return_dict=True,
        return_assistant_tokens_mask=True,
    )
    ids, generation = torch.tensor(out["input_ids"]), torch.tensor(out["assistant_masks"])
    assert tokenizer.decode(ids[generation.bool()]).count(f"{end}\n") == 3
    masker = MaskerCache(MaskingOptions()).get(tokenizer)
    log.reset_warnings()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        used = masker.mask(ids, assistant_mask=generation)
    assert torch.equal(used, masker.mask(ids))
    assert trained_spans(tokenizer, ids, used)[-1].endswith(end)


def test_explain_highlights_trained_spans():
    out = io.StringIO()
    shown = explain(load_tokenizer("gemma3"), CHAT, file=out, color=False)
    assert out.getvalue() == shown + "\n"
    assert "[[I am a helpful bot.<end_of_turn>]]" in shown
    assert "[[It is 6.<end_of_turn>]]" in shown
    assert "[[Hi there" not in shown
    colored = explain(load_tokenizer("gemma3"), CHAT, file=io.StringIO(), color=True)
    assert "\033[1;32mIt is 6.<end_of_turn>\033[0m" in colored
