"""Exact trained spans with the real tokenizers and their real chat templates.

Qwen3 (ChatML), Llama 3.1 and Gemma 3 render through their own chat templates. The Mistral v3
SentencePiece tokenizer ships without a template, so its prompts are built by hand the way
mistral-common's v3 instruct tokenizer builds them: ``<s>[INST] user[/INST] answer</s>...`` with
the system prompt prepended to the last user message.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from _tokenizers import load_tokenizer

from autooffload.masking import IGNORE_INDEX, MaskerCache, MaskingOptions

SYSTEM = "You are a terse assistant."
CHAT = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "Hi there, who are you?"},
    {"role": "assistant", "content": "I am a helpful bot."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "It is 4."},
    {"role": "user", "content": "And 3+3?"},
    {"role": "assistant", "content": "It is 6."},
]
QWEN_EMPTY_THINK = "<think>\n\n</think>\n\n"


def render(family: str, messages: list[dict]) -> list[int]:
    """Token ids of ``messages`` as the family's real template (or mistral-common) renders them."""
    tokenizer = load_tokenizer(family)
    if family != "mistral-v3-sp":
        text = tokenizer.apply_chat_template(messages, tokenize=False)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    system = next((m["content"] for m in messages if m["role"] == "system"), None)
    turns = [m for m in messages if m["role"] != "system"]
    last_user = max(i for i, m in enumerate(turns) if m["role"] == "user")
    ids = [tokenizer.bos_token_id]
    for index, message in enumerate(turns):
        content = message["content"]
        encoded = tokenizer.encode(content, add_special_tokens=False)
        if message["role"] == "user":
            if system and index == last_user:
                encoded = tokenizer.encode(f"{system}\n\n{content}", add_special_tokens=False)
            ids += [3] + encoded + [4]  # [INST] ... [/INST]
        else:
            ids += encoded + [tokenizer.eos_token_id]
    return ids


def expected_turns(family: str, messages: list[dict]) -> list[tuple[str, str, str, bool]]:
    """(role, exact content, end marker, end marker trainable) of each turn, in order."""
    end = {"qwen3": "<|im_end|>", "llama3.1": "<|eot_id|>", "gemma3": "<end_of_turn>"}
    turns = []
    system = messages[0]["content"] if messages[0]["role"] == "system" else None
    rest = messages[1:] if system else messages
    last_assistant = max(i for i, m in enumerate(rest) if m["role"] == "assistant")
    last_user = max(i for i, m in enumerate(rest) if m["role"] == "user")
    if system and family in ("qwen3", "llama3.1"):
        turns.append(("system", system, end[family], True))
    for index, message in enumerate(rest):
        role, content = message["role"], message["content"]
        if family == "qwen3" and role == "assistant" and index == last_assistant:
            content = QWEN_EMPTY_THINK + content
        if family == "gemma3" and system and index == 0:
            content = f"{system}\n\n{content}"  # Gemma folds the system prompt into the user turn
        if family == "mistral-v3-sp":
            if role == "user":
                content = f"{system}\n\n{content}" if system and index == last_user else content
                turns.append((role, content, "[/INST]", False))
            else:
                turns.append((role, content, "</s>", True))
            continue
        turns.append((role, content, end[family], True))
    return turns


def expected_spans(turns, roles: tuple[str, ...], eos: str) -> list[str]:
    last = max((i for i, t in enumerate(turns) if t[0] in roles), default=-1)
    spans = []
    for index, (role, content, end, end_trainable) in enumerate(turns):
        trained = role in roles
        eos_on = end_trainable and (
            eos == "all" or (trained and (eos == "turn" or (eos == "last" and index == last)))
        )
        if trained:
            spans.append(content + (end if eos_on else ""))
        elif eos_on:
            spans.append(end)
    return spans


def trained_spans(tokenizer, ids: torch.Tensor, labels: torch.Tensor) -> list[str]:
    """Each run of consecutive trained tokens, decoded."""
    trained = (labels != IGNORE_INDEX).tolist()
    spans, run = [], []
    for token, keep in zip(ids.tolist(), trained):
        if keep:
            run.append(token)
        elif run:
            spans.append(tokenizer.decode(run))
            run = []
    if run:
        spans.append(tokenizer.decode(run))
    return spans


def masker_for(family: str, roles=("assistant",), eos="turn", inputs=False, boundaries=None):
    cache = MaskerCache(MaskingOptions(inputs, tuple(roles), eos), boundaries)
    return cache.get(load_tokenizer(family))


FAMILIES = ["qwen3", "llama3.1", "gemma3", "mistral-v3-sp"]
EOS_MODES = ["turn", "last", "all", "none"]
ROLE_SETS = [("assistant",), ("assistant", "user"), ("user",), (), ("system", "assistant")]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(
    ("roles", "eos"), itertools.product(ROLE_SETS, ["turn", "last", "all", "none"])
)
def test_trained_spans_are_exactly_the_role_contents(family, roles, eos):
    ids = torch.tensor(render(family, CHAT))
    labels = masker_for(family, roles, eos).mask(ids)
    got = trained_spans(load_tokenizer(family), ids, labels)
    assert got == expected_spans(expected_turns(family, CHAT), roles, eos)


@pytest.mark.parametrize("family", FAMILIES)
def test_train_on_inputs_trains_everything(family):
    ids = torch.tensor(render(family, CHAT))
    labels = masker_for(family, inputs=True).mask(ids)
    assert torch.equal(labels, ids)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_batch_matches_each_sample(family, side):
    tokenizer = load_tokenizer(family)
    samples = [render(family, CHAT), render(family, CHAT[:3]), render(family, CHAT[:5])]
    width = max(map(len, samples))
    # Llama 3 has no pad token: pad with eos, as users do, so pad == the end-of-turn marker.
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    ids = torch.full((len(samples), width), pad)
    attention = torch.zeros_like(ids)
    for row, sample in enumerate(samples):
        cols = slice(width - len(sample), width) if side == "left" else slice(0, len(sample))
        ids[row, cols] = torch.tensor(sample)
        attention[row, cols] = 1
    masker = masker_for(family, ("assistant",), "turn")
    labels = masker.mask(ids, ids.clone(), attention_mask=attention)
    for row, sample in enumerate(samples):
        alone = masker.mask(torch.tensor(sample))
        cols = slice(width - len(sample), width) if side == "left" else slice(0, len(sample))
        assert torch.equal(labels[row, cols], alone)
        assert bool((labels[row][attention[row] == 0] == IGNORE_INDEX).all())


@pytest.mark.parametrize("family", ["qwen3", "llama3.1", "gemma3"])
@pytest.mark.parametrize("eos", ["turn", "last"])
def test_truncated_final_turn_runs_to_the_end(family, eos):
    tokenizer = load_tokenizer(family)
    text = tokenizer.apply_chat_template(CHAT, tokenize=False)
    cut = text.rindex("It is 6.") + len("It is")
    ids = torch.tensor(tokenizer(text[:cut], add_special_tokens=False)["input_ids"])
    got = trained_spans(tokenizer, ids, masker_for(family, eos=eos).mask(ids))
    prefix = QWEN_EMPTY_THINK if family == "qwen3" else ""
    ends = {"qwen3": "<|im_end|>", "llama3.1": "<|eot_id|>", "gemma3": "<end_of_turn>"}[family]
    first = ["I am a helpful bot." + ends, "It is 4." + ends] if eos == "turn" else []
    assert got[-1] == prefix + "It is"
    if eos == "turn":
        assert got == first + [prefix + "It is"]
    else:  # the last trained turn is cut before its end marker: no end marker is trained
        assert got == ["I am a helpful bot.", "It is 4.", prefix + "It is"]


def test_mistral_truncated_final_turn():
    tokenizer = load_tokenizer("mistral-v3-sp")
    answer = tokenizer.encode("It is 6.", add_special_tokens=False)
    ids = torch.tensor(render("mistral-v3-sp", CHAT)[:-3])  # cut "6", "." and </s>
    got = trained_spans(tokenizer, ids, masker_for("mistral-v3-sp").mask(ids))
    assert got == ["I am a helpful bot.</s>", "It is 4.</s>", tokenizer.decode(answer[:-2])]


def test_mistral_inst_close_is_shared_not_consumed():
    """[/INST] ends the user turn and starts the answer; it is never trained as either."""
    ids = torch.tensor(render("mistral-v3-sp", CHAT))
    labels = masker_for("mistral-v3-sp", ("assistant", "user"), "all").mask(ids)
    assert bool((labels[ids == 4] == IGNORE_INDEX).all())
    assert len(trained_spans(load_tokenizer("mistral-v3-sp"), ids, labels)) == 6


def test_qwen3_think_content_is_trained():
    messages = CHAT[:-1] + [
        {"role": "assistant", "content": "It is 6.", "reasoning_content": "Add 3 and 3."}
    ]
    ids = torch.tensor(render("qwen3", messages))
    got = trained_spans(load_tokenizer("qwen3"), ids, masker_for("qwen3").mask(ids))
    assert got[-1] == "<think>\nAdd 3 and 3.\n</think>\n\nIt is 6.<|im_end|>"


def test_override_with_include_start_and_token_ids():
    tokenizer = load_tokenizer("qwen3")
    start_ids = tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)
    boundaries = [
        {
            "role": "assistant",
            "start": start_ids,
            "end": "<|im_end|>",
            "include_start": True,
            "include_end": False,
        },
    ]
    ids = torch.tensor(render("qwen3", CHAT))
    got = trained_spans(tokenizer, ids, masker_for("qwen3", boundaries=boundaries).mask(ids))
    assert got == [
        "<|im_start|>assistant\nI am a helpful bot.",
        "<|im_start|>assistant\nIt is 4.",
        "<|im_start|>assistant\n" + QWEN_EMPTY_THINK + "It is 6.",
    ]


def test_override_with_eos_token_and_open_end():
    tokenizer = load_tokenizer("mistral-v3-sp")
    boundaries = [
        {
            "role": "user",
            "start": "[INST]",
            "end": None,
            "include_start": False,
            "include_end": False,
        },
        {
            "role": "assistant",
            "start": "[/INST]",
            "end": "eos_token",
            "include_start": False,
            "include_end": True,
        },
    ]
    ids = torch.tensor(render("mistral-v3-sp", CHAT))
    masker = masker_for("mistral-v3-sp", ("user",), boundaries=boundaries)
    got = trained_spans(tokenizer, ids, masker.mask(ids))
    assert got == ["Hi there, who are you?", "What is 2+2?", f"{SYSTEM}\n\nAnd 3+3?"]


# ChatML as many fine-tuning templates write it: the content is not stripped.
PLAIN_CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
)


@pytest.mark.parametrize("answer", ["\n```py\nx = 1\n```", "\n\nTwo blank lines first.", "Plain."])
def test_an_answer_opening_with_newlines_is_trained(answer):
    """The marker's ``\\n`` and the answer's leading newlines tokenize as one token (``\\n\\n``,
    ``\\n\\n\\n``): the turn was not found and went untrained. The merged token is the marker's;
    the answer's text after it trains."""
    tokenizer = load_tokenizer("qwen3")
    messages = [
        {"role": "user", "content": "Show me."},
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "\nAgain?"},
        {"role": "assistant", "content": answer},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, chat_template=PLAIN_CHATML)
    ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"])
    tokens = ids.tolist()
    after_role = tokens[tokens.index(tokenizer.convert_tokens_to_ids("assistant")) + 1]
    assert (tokenizer.decode([after_role]) == "\n") == (not answer.startswith("\n"))
    got = trained_spans(tokenizer, ids, masker_for("qwen3").mask(ids))
    assert got == [answer.lstrip("\n") + "<|im_end|>"] * 2
    users = trained_spans(tokenizer, ids, masker_for("qwen3", roles=("user",)).mask(ids))
    assert users == ["Show me.<|im_end|>", "Again?<|im_end|>"]


TOOL_CHAT = [
    {"role": "user", "content": "Weather?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}
        ],
    },
    {"role": "tool", "content": "sunny"},
    {"role": "tool", "content": "22C"},
    {"role": "assistant", "content": "Sunny, 22C."},
]


@pytest.mark.parametrize(
    ("roles", "expected"),
    [
        (
            ("tool",),
            ["\nsunny\n</tool_response>\n<tool_response>\n22C\n</tool_response><|im_end|>"],
        ),
        (("user",), ["Weather?<|im_end|>"]),
    ],
)
def test_qwen3_tool_results_are_the_tool_role_not_the_user(roles, expected):
    """Qwen 3 renders tool results in a user turn opened by ``<tool_response>``: they are the
    ``tool`` role's (they trained as ``user`` and never as ``tool``)."""
    tokenizer = load_tokenizer("qwen3")
    ids = torch.tensor(render("qwen3", TOOL_CHAT))
    assert trained_spans(tokenizer, ids, masker_for("qwen3", roles=roles).mask(ids)) == expected


def packed(*sequences: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """One packed row (TRL ``padding_free``): the ids, and position ids restarting per sequence."""
    ids = torch.tensor([t for sequence in sequences for t in sequence])[None]
    positions = torch.cat([torch.arange(len(sequence)) for sequence in sequences])[None]
    return ids, positions


def test_packed_sequences_are_masked_each_as_its_own_row():
    """``train_on_eos="last"`` trains each sequence's last answer's end; a plain-text sequence
    packed beside chat keeps its labels; a truncated answer stops where its sequence ends."""
    tokenizer = load_tokenizer("qwen3")
    chat = render("qwen3", CHAT)
    plain = tokenizer("Plain pretraining text.", add_special_tokens=False)["input_ids"]
    cut = render("qwen3", CHAT[:3])[:-4]  # the first answer, cut before its end marker
    ids, positions = packed(chat, plain, cut, chat)
    labels = ids.masked_fill(positions == 0, -100)  # TRL: no label across a sequence start
    masker = masker_for("qwen3", eos="last")
    masked = masker.mask(ids, labels, position_ids=positions)[0]
    alone = [masker.mask(torch.tensor(s)) for s in (chat, plain, cut, chat)]
    expected = torch.cat([a if a is not None else torch.tensor(plain) for a in alone])
    expected[positions[0] == 0] = -100
    assert masked.tolist() == expected.tolist()
    spans = trained_spans(tokenizer, ids[0], masked)
    # Each conversation's last end trains; the cut answer stops with its sequence.
    assert [s for s in spans if s.endswith("<|im_end|>")] == [
        f"{QWEN_EMPTY_THINK}It is 6.<|im_end|>"
    ] * 2
    assert f"{QWEN_EMPTY_THINK}I am a helpful" in spans
    assert " pretraining text." in spans  # (its first token has no label: a sequence start)
    # Without the positions the row is one conversation: the plain text is masked away, and
    # only the row's final end marker trains.
    flat = trained_spans(tokenizer, ids[0], masker.mask(ids, labels)[0])
    assert not any("pretraining" in span for span in flat)
    assert sum(span.endswith("<|im_end|>") for span in flat) == 1


def test_padding_at_position_zero_is_not_a_packed_sequence():
    """A padded batch with position ids (TRL's ``return_position_ids``) pads them with 0: not
    sequence starts, so the batch is masked as padded rows."""
    from autooffload.masking.labels import packed_segments

    positions = np.array([[0, 1, 2, 0, 0, 0], [0, 1, 2, 3, 4, 5]])
    attention = np.array([[1, 1, 1, 0, 0, 0], [1] * 6])
    assert packed_segments(positions, attention) is None
    # Without an attention mask a run of zeros is one start, not one sequence per pad.
    assert packed_segments(positions).shape == (3, 6)
    assert packed_segments(np.array([[0, 1, 0, 1, 2, 0]])).shape == (3, 3)
