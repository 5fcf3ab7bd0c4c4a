"""The collator, processor and forward patches give assistant-only labels; disable() undoes it."""

from __future__ import annotations

import copy
import functools
import warnings
from pathlib import Path

import pytest
import torch
from tokenizer_data import tokenizer_dir

import autooffload
from autooffload.masking import IGNORE_INDEX

TOKENIZERS = Path(__file__).resolve().parents[1] / "data" / "tokenizers"
CHAT = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "Hi there, who are you?"},
    {"role": "assistant", "content": "I am a helpful bot."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "It is 4."},
]
ANSWERS = ["I am a helpful bot.<|im_end|>", "<think>\n\n</think>\n\nIt is 4.<|im_end|>"]


@functools.cache
def tokenizer(name: str = "qwen3"):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir(name))


def spans(tok, ids: torch.Tensor, labels: torch.Tensor) -> list[str]:
    out, run = [], []
    for token, label in zip(ids.tolist(), labels.tolist()):
        if label != IGNORE_INDEX:
            run.append(token)
        elif run:
            out.append(tok.decode(run))
            run = []
    return out + ([tok.decode(run)] if run else [])


def chat_features(tok, conversations):
    rendered = [tok.apply_chat_template(c, tokenize=True, return_dict=True) for c in conversations]
    return [{"input_ids": list(r["input_ids"])} for r in rendered]


def test_transformers_lm_collator_masks_and_disable_restores():
    from transformers import DataCollatorForLanguageModeling

    autooffload.enable(device="cpu")
    tok = tokenizer()
    collator = DataCollatorForLanguageModeling(tok, mlm=False)
    features = chat_features(tok, [CHAT, CHAT[:3]])
    batch = collator(features)
    assert spans(tok, batch["input_ids"][0], batch["labels"][0]) == ANSWERS
    assert spans(tok, batch["input_ids"][1], batch["labels"][1]) == [
        "<think>\n\n</think>\n\nI am a helpful bot.<|im_end|>"
    ]
    numpy_batch = collator(features, return_tensors="np")
    assert (numpy_batch["labels"] == batch["labels"].numpy()).all()
    autooffload.disable()
    plain = collator(features)
    assert torch.equal(plain["labels"][0], plain["input_ids"][0])


@pytest.mark.parametrize("return_tensors", ["pt", "np"])
def test_transformers_lm_collator_with_pad_eos_trains_the_end_markers(return_tensors):
    """Llama 3 with ``pad_token = eos_token``: the collator makes every ``<|eot_id|>`` -100 as a
    pad, so no turn end trained (the model never learnt to stop). Chat rows are masked from the
    ids with pads from the attention mask; a plain-text row keeps the collator's labels."""
    from transformers import AutoTokenizer, DataCollatorForLanguageModeling

    tok = AutoTokenizer.from_pretrained(tokenizer_dir("llama3.1"))
    tok.pad_token = tok.eos_token
    chat = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "More?"},
        {"role": "assistant", "content": "Sure."},
    ]
    ids = list(tok.apply_chat_template(chat, tokenize=True, return_dict=True)["input_ids"])
    plain = tok("Just some text<|eot_id|>", add_special_tokens=False)["input_ids"]
    collator = DataCollatorForLanguageModeling(tok, mlm=False, return_tensors=return_tensors)
    unmasked = collator([{"input_ids": ids}, {"input_ids": plain}])
    autooffload.enable(device="cpu")
    batch = collator([{"input_ids": ids}, {"input_ids": plain}])
    autooffload.disable()
    input_ids, labels = torch.as_tensor(batch["input_ids"]), torch.as_tensor(batch["labels"])
    assert spans(tok, input_ids[0], labels[0]) == ["Hello!<|eot_id|>", "Sure.<|eot_id|>"]
    assert torch.equal(labels[1], torch.as_tensor(unmasked["labels"][1]))  # plain row untouched
    assert (labels[1][torch.as_tensor(batch["attention_mask"][1]) == 0] == IGNORE_INDEX).all()


def test_seq2seq_collator_keeps_prebuilt_masks_and_masks_the_rest():
    from transformers import DataCollatorForSeq2Seq

    autooffload.enable(device="cpu", train_on_eos="none")
    tok = tokenizer()
    features = chat_features(tok, [CHAT])
    features[0]["labels"] = list(features[0]["input_ids"])
    batch = DataCollatorForSeq2Seq(tok)(features)
    assert spans(tok, batch["input_ids"][0], batch["labels"][0]) == [
        "I am a helpful bot.",
        "<think>\n\n</think>\n\nIt is 4.",
    ]


def test_plain_text_batches_are_untouched():
    from transformers import DataCollatorForLanguageModeling

    autooffload.enable(device="cpu")
    tok = tokenizer()
    features = [{"input_ids": tok.encode("Once upon a time.")}]
    batch = DataCollatorForLanguageModeling(tok, mlm=False)(features)
    assert torch.equal(batch["labels"], batch["input_ids"])


def test_trl_text_collator_uses_the_sft_trainer_tokenizer():
    sft = pytest.importorskip("trl.trainer.sft_trainer")
    autooffload.enable(device="cpu", roles_to_train=["assistant", "user"])
    tok = tokenizer()
    features = chat_features(tok, [CHAT, CHAT[:3]])
    collator = sft.DataCollatorForLanguageModeling(pad_token_id=tok.pad_token_id)
    from autooffload.patches import hf_collators

    hf_collators._session.bind(collator, tok)  # what the SFTTrainer.__init__ patch does
    batch = collator(features)
    assert spans(tok, batch["input_ids"][1], batch["labels"][1]) == [
        "Hi there, who are you?<|im_end|>",
        "<think>\n\n</think>\n\nI am a helpful bot.<|im_end|>",
    ]


def test_trl_collator_skips_the_label_compare_only_when_its_labels_are_the_padded_ids():
    sft = pytest.importorskip("trl.trainer.sft_trainer")
    from autooffload.patches import hf_collators

    autooffload.enable(device="cpu")
    tok = tokenizer()
    collator = sft.DataCollatorForLanguageModeling(pad_token_id=tok.pad_token_id)
    hf_collators._session.bind(collator, tok)
    features = chat_features(tok, [CHAT, CHAT[:3], CHAT[:2]])
    assert hf_collators.trl_labels_match_ids(collator, features)
    original = type(collator).torch_call.__wrapped__
    unmasked = original(collator, copy.deepcopy(features))
    masker = hf_collators._session.masker(tok)
    args = (unmasked["input_ids"], unmasked["labels"], unmasked["attention_mask"])
    fast = masker.mask(*args, labels_match_ids=True, count=False)
    slow = masker.mask(*args, count=False)
    assert torch.equal(fast, slow)
    assert torch.equal(collator(copy.deepcopy(features))["labels"], slow)
    assert spans(tok, unmasked["input_ids"][0], slow[0]) == ANSWERS
    # Examples that bring labels (here shifted ones, not a copy of the ids) take the full path,
    # which leaves such rows alone; the fast path would have masked them.
    shifted = [{**f, "labels": f["input_ids"][1:] + [tok.pad_token_id]} for f in features]
    assert not hf_collators.trl_labels_match_ids(collator, shifted)
    batch = collator(copy.deepcopy(shifted))
    expected = original(collator, copy.deepcopy(shifted))["labels"]
    assert torch.equal(batch["labels"], expected)
    masked_fast = masker.mask(
        batch["input_ids"], expected, batch["attention_mask"], labels_match_ids=True, count=False
    )
    assert not torch.equal(masked_fast, expected)  # why the check matters
    padding_free = sft.DataCollatorForLanguageModeling(
        pad_token_id=tok.pad_token_id, padding_free=True
    )
    assert not hf_collators.trl_labels_match_ids(padding_free, features)


def test_trl_padding_free_collator_masks_each_packed_sequence():
    """``padding_free=True``: one row, position ids restarting per example. Each example is
    masked as its own (a plain-text one keeps its labels); TRL's -100 at every sequence start
    stays."""
    sft = pytest.importorskip("trl.trainer.sft_trainer")
    from autooffload.patches import hf_collators

    autooffload.enable(device="cpu")
    tok = tokenizer()
    collator = sft.DataCollatorForLanguageModeling(pad_token_id=tok.pad_token_id, padding_free=True)
    hf_collators._session.bind(collator, tok)
    plain = {"input_ids": tok("Plain pretraining text.", add_special_tokens=False)["input_ids"]}
    features = chat_features(tok, [CHAT]) + [plain] + chat_features(tok, [CHAT[:3]])
    batch = collator(copy.deepcopy(features))
    assert batch["input_ids"].shape[0] == 1 and "position_ids" in batch
    got = spans(tok, batch["input_ids"][0], batch["labels"][0])
    assert got == ANSWERS + [" pretraining text."] + [
        "<think>\n\n</think>\n\nI am a helpful bot.<|im_end|>"
    ]


def test_sft_packing_that_cuts_chats_into_pieces_warns(tmp_path):
    """``packing_strategy="wrapped"`` cuts conversations into pieces, and a piece without a role
    marker keeps every label (here a whole user turn): one warning says so; ``bfd`` truncates
    instead, and warns nothing."""
    pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    from trl import SFTConfig, SFTTrainer

    autooffload.enable(device="cpu")
    tok = tokenizer()
    model = tiny_causal_lm(len(tok))
    long_question = [{"role": "user", "content": "Tell me about cats. " * 8}, *CHAT[2:3]]
    rows = datasets.Dataset.from_list([{"messages": CHAT}, {"messages": long_question}])
    for strategy, warned in (("bfd", False), ("wrapped", True)):
        config = SFTConfig(
            output_dir=str(tmp_path),
            packing=True,
            packing_strategy=strategy,
            max_length=16,
            report_to=[],
            use_cpu=True,
            bf16=False,
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer = SFTTrainer(model=model, args=config, train_dataset=rows, processing_class=tok)
        cut = [w for w in caught if "packing_strategy" in str(w.message)]
        assert len(cut) == warned, [str(w.message) for w in cut]
    pieces = [trainer.train_dataset[i] for i in range(len(trainer.train_dataset))]
    batch = trainer.data_collator(pieces)
    user_text = [
        s
        for row, labels in zip(batch["input_ids"], batch["labels"])
        for s in spans(tok, row, labels)
        if "cats" in s
    ]
    assert user_text  # what the warning is about


def test_trl_vision_collator_masks_prompt_and_image_tokens():
    sft = pytest.importorskip("trl.trainer.sft_trainer")
    from PIL import Image
    from transformers.models.gemma3 import Gemma3ImageProcessorPil, Gemma3Processor

    autooffload.enable(device="cpu")
    tok = tokenizer("gemma3")
    processor = Gemma3Processor(
        image_processor=Gemma3ImageProcessorPil(), tokenizer=tok, chat_template=tok.chat_template
    )
    image = Image.new("RGB", (16, 16), (255, 0, 0))
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Colour?"},  # TRL puts the image placeholder here
        {"role": "assistant", "content": "Red."},
        {"role": "user", "content": "Sure?"},
        {"role": "assistant", "content": "Yes."},
    ]
    collator = sft.DataCollatorForVisionLanguageModeling(processor)
    batch = collator([{"images": [image], "messages": copy.deepcopy(messages)} for _ in range(2)])
    ids, labels = batch["input_ids"], batch["labels"]
    assert (ids == tok.image_token_id).sum() > 0
    for row in range(2):
        assert spans(tok, ids[row], labels[row]) == ["Red.<end_of_turn>", "Yes.<end_of_turn>"]
    autooffload.disable()
    unmasked = collator([{"images": [image], "messages": copy.deepcopy(messages)}])
    assert bool((unmasked["labels"] == unmasked["input_ids"]).all())


def tiny_causal_lm(vocab_size: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
    )
    return LlamaForCausalLM(config)


def test_hand_written_collate_is_caught_at_the_forward():
    from transformers import DataCollatorForLanguageModeling

    tok = tokenizer()
    model = tiny_causal_lm(len(tok))
    texts = [tok.apply_chat_template(c, tokenize=False) for c in (CHAT, CHAT[:3])]

    def collate_fn(texts):  # the pattern of many VLM fine-tuning scripts
        batch = tok(texts, padding=True, return_tensors="pt")
        batch["labels"] = batch["input_ids"].clone()
        return batch

    unmasked_loss = model(**collate_fn(texts)).loss
    autooffload.enable(device="cpu", offload=False)
    batch = collate_fn(texts)
    masked_loss = model(**batch).loss
    features = chat_features(tok, [CHAT, CHAT[:3]])
    reference = DataCollatorForLanguageModeling(tok, mlm=False)(features)
    expected = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    logits = expected.logits[:, :-1].reshape(-1, expected.logits.shape[-1])
    target = reference["labels"][:, 1:].reshape(-1)
    assert torch.allclose(masked_loss, torch.nn.functional.cross_entropy(logits, target))
    assert not torch.allclose(masked_loss, unmasked_loss)
    autooffload.disable()
    assert torch.allclose(model(**collate_fn(texts)).loss, unmasked_loss)


def test_forward_leaves_plain_text_alone():
    tok = tokenizer()
    model = tiny_causal_lm(len(tok))
    batch = tok(["Once upon a time."], return_tensors="pt")
    before = model(**batch, labels=batch["input_ids"].clone()).loss
    autooffload.enable(device="cpu", offload=False)
    tok("warm up")  # the tokenizer in use is known
    assert torch.allclose(model(**batch, labels=batch["input_ids"].clone()).loss, before)


def test_flattening_collator_and_packed_forward_mask_each_sequence():
    """transformers' ``DataCollatorWithFlattening`` packs a batch into one row whose position ids
    restart per example: each example is masked as its own, so a plain-text one keeps its
    labels. A hand-written packed batch (position ids, no attention mask, ``labels`` a copy of
    the ids) gets the same labels at the model's forward."""
    from transformers import DataCollatorWithFlattening

    autooffload.enable(device="cpu", offload=False)
    tok = tokenizer()
    plain = {"input_ids": tok("Plain pretraining text.", add_special_tokens=False)["input_ids"]}
    features = chat_features(tok, [CHAT]) + [plain] + chat_features(tok, [CHAT[:3]])
    batch = DataCollatorWithFlattening()(copy.deepcopy(features))
    ids, positions = batch["input_ids"], batch["position_ids"]
    assert spans(tok, ids[0], batch["labels"][0]) == [
        *ANSWERS,
        " pretraining text.",
        "<think>\n\n</think>\n\nI am a helpful bot.<|im_end|>",
    ]
    model = tiny_causal_lm(len(tok))
    loss = model(input_ids=ids, position_ids=positions, labels=ids.clone()).loss
    expected = batch["labels"].clone()
    plain_start = len(features[0]["input_ids"])
    expected[0, plain_start] = ids[0, plain_start]  # the collator's -100 at a sequence start
    logits = model(input_ids=ids, position_ids=positions).logits[0, :-1]
    assert torch.allclose(loss, torch.nn.functional.cross_entropy(logits, expected[0, 1:]))


def test_assistant_tokens_mask_of_a_template_without_generation_is_not_cross_checked():
    """Without ``{% generation %}`` transformers returns an all-zero assistant mask (and says
    so): that is no disagreement with the role boundaries."""
    autooffload.enable(device="cpu")
    tok = tokenizer()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = tok.apply_chat_template(
            CHAT, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
    assert not any(out["assistant_masks"])


def test_mask_false_installs_nothing():
    from autooffload.patches import _registry

    autooffload.enable(device="cpu", mask=False)
    import transformers  # noqa: F401

    assert not [r for r in _registry.records() if r.group.endswith("hf_collators")]


@pytest.fixture
def records():
    """What the ``autooffload`` logger emits at DEBUG and above during the test."""
    import logging

    caught: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = caught.append
    logger = logging.getLogger("autooffload")
    logger.addHandler(handler)
    old_level = logger.level
    logger.setLevel(logging.DEBUG)
    yield caught
    logger.removeHandler(handler)
    logger.setLevel(old_level)


def _masking_lines(records, level: str = "INFO") -> list[str]:
    return [
        r.getMessage()
        for r in records
        if r.getMessage().startswith("masking:") and r.levelname == level
    ]


def test_one_info_line_at_the_first_batch_masking_changes(records):
    from transformers import DataCollatorForLanguageModeling

    autooffload.enable(device="cpu")
    tok = tokenizer()
    collator = DataCollatorForLanguageModeling(tok, mlm=False)
    first = collator(chat_features(tok, [CHAT, CHAT[:3]]))
    collator(chat_features(tok, [CHAT]))
    lines = _masking_lines(records)
    assert len(lines) == 1, lines
    total = int((first["attention_mask"] != 0).sum())
    kept = int((first["labels"] != IGNORE_INDEX).sum())
    assert 0 < kept < total
    for words in (
        "chatml",
        "assistant",
        f"keeps {kept} of {total} label tokens",
        "AUTOOFFLOAD_MASK=0",
    ):
        assert words in lines[0], lines[0]


def test_plain_text_batches_log_nothing_about_masking(records):
    from transformers import DataCollatorForLanguageModeling

    autooffload.enable(device="cpu")
    tok = tokenizer()
    collator = DataCollatorForLanguageModeling(tok, mlm=False)
    texts = ["The quick brown fox jumps over the lazy dog.", "Plain text, no chat at all."]
    batch = collator([{"input_ids": tok(t)["input_ids"]} for t in texts])
    assert torch.equal(batch["labels"] != IGNORE_INDEX, batch["attention_mask"] != 0)
    autooffload.disable()
    assert not [r for r in records if r.levelname != "DEBUG"], [r.getMessage() for r in records]
