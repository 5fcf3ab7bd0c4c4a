"""TRL's SFTTrainer runs a vision-language model unchanged on an attached model (CPU simulation):
a Gemma 3 with a SigLIP tower and a Gemma3Processor learns on assistant-only labels, and its
checkpoint reloads into a plain model with identical outputs."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from PIL import Image
from sft_runs import assert_last_checkpoint_reloads, cpu_sft_config
from tokenizer_data import tokenizer_dir
from transformers import (
    AutoTokenizer,
    Gemma3Config,
    Gemma3ForConditionalGeneration,
    Gemma3TextConfig,
    SiglipVisionConfig,
)
from transformers.models.gemma3 import Gemma3ImageProcessorPil, Gemma3Processor
from trl import SFTTrainer

import autooffload
from autooffload import runtime as rt
from autooffload.masking import IGNORE_INDEX

pytestmark = pytest.mark.slow

SFT_STEPS = 6
IMAGE_SIZE = 32
PATCH_SIZE = 8
# The projector average-pools the (32 / 8)^2 = 16 patches into a 2 x 2 grid: 4 soft tokens.
IMAGE_TOKENS = 4
COLOURS = {"red": (255, 0, 0), "green": (0, 255, 0), "blue": (0, 0, 255), "yellow": (255, 255, 0)}


@pytest.fixture(autouse=True)
def _clean_state():
    yield
    autooffload.disable()


def gemma3_processor() -> Gemma3Processor:
    """The real Gemma 3 tokenizer with a 32 x 32 image processor and 4 soft tokens per image."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir("gemma3"))
    image_processor = Gemma3ImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    return Gemma3Processor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        chat_template=tokenizer.chat_template,
        image_seq_length=IMAGE_TOKENS,
    )


def tiny_gemma3(tokenizer) -> Gemma3ForConditionalGeneration:
    """A random-init Gemma 3 (2 text layers, 2 SigLIP layers, width 32) over the full vocabulary."""
    torch.manual_seed(0)
    text_config = Gemma3TextConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        query_pre_attn_scalar=8,
        max_position_embeddings=512,
        sliding_window=64,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    vision_config = SiglipVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=IMAGE_SIZE,
        patch_size=PATCH_SIZE,
        vision_use_head=False,  # Gemma 3 reads the tower's last hidden state, never a pooled head
    )
    config = Gemma3Config(
        text_config=text_config,
        vision_config=vision_config,
        mm_tokens_per_image=IMAGE_TOKENS,
        boi_token_index=tokenizer.boi_token_id,
        eoi_token_index=tokenizer.eoi_token_id,
        image_token_index=tokenizer.image_token_id,
    )
    return Gemma3ForConditionalGeneration(config)


def conversation(colour: str) -> dict:
    """One row of TRL's vision dataset format: a plain-colour image and a one-word answer."""
    image = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), COLOURS[colour])
    messages = [
        {"role": "system", "content": "Answer in one word."},
        {"role": "user", "content": "Which colour is this picture?"},  # TRL adds the image here
        {"role": "assistant", "content": f"{colour.capitalize()}."},
    ]
    return {"images": [image], "messages": messages}


def probe_inputs(processor: Gemma3Processor) -> dict[str, torch.Tensor]:
    """One processed prompt with a green image, as the model is asked at inference."""
    image = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), COLOURS["green"])
    messages = [
        {"role": "system", "content": [{"type": "text", "text": "Answer in one word."}]},
        {
            "role": "user",
            "content": [
                {"type": "image", "image": image},
                {"type": "text", "text": "Which colour is this?"},
            ],
        },
    ]
    inputs = processor.apply_chat_template(
        messages,
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
        return_tensors="pt",
    )
    assert int((inputs["input_ids"] == processor.tokenizer.image_token_id).sum()) == IMAGE_TOKENS
    return dict(inputs)


def answers(tokenizer, input_ids: torch.Tensor, labels: torch.Tensor) -> list[str]:
    """The decoded runs of trained (not -100) labels of one row."""
    out, run = [], []
    for token, label in zip(input_ids.tolist(), labels.tolist()):
        if label != IGNORE_INDEX:
            assert label == token, (label, token)
            run.append(token)
        elif run:
            out.append(tokenizer.decode(run))
            run = []
    return out + ([tokenizer.decode(run)] if run else [])


def test_sft_trainer_trains_a_vision_language_model_attached_and_its_checkpoint_reloads(
    tmp_path: Path,
) -> None:
    # n_persist=0: every chunk is offloaded, the SigLIP tower's and projector's included.
    autooffload.enable(
        device="cpu", force_attach=True, chunk_size=200_000, n_persist=0, log="warning"
    )
    processor = gemma3_processor()
    tokenizer = processor.tokenizer
    model = tiny_gemma3(tokenizer)
    initial_tower = {k: v.clone() for k, v in model.model.vision_tower.state_dict().items()}
    rows = [conversation(colour) for colour in COLOURS]
    args = cpu_sft_config(tmp_path, SFT_STEPS, per_device_train_batch_size=len(rows))
    trainer = SFTTrainer(
        model=model,
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=processor,
    )
    model = trainer.model
    runtime = rt.runtime_of(model)
    assert runtime is not None, "the SFTTrainer's move to cpu did not attach the model"
    assert autooffload.last_plan() is not None
    tower = list(model.model.vision_tower.named_parameters())
    assert tower and all(runtime.is_offloaded(p) for _, p in tower), "vision tower not chunked"
    assert runtime.is_offloaded(model.model.multi_modal_projector.mm_input_projection_weight)
    assert runtime.is_offloaded(model.lm_head.weight)

    batches = []
    collate = trainer.data_collator

    def recording_collator(examples):
        batch = collate(examples)
        batches.append({k: batch[k].clone() for k in ("input_ids", "labels")})
        return batch

    trainer.data_collator = recording_collator
    trainer.train()

    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == SFT_STEPS and all(math.isfinite(loss) for loss in losses), losses
    # ln(262k) = 12.5 at the start; six steps on the four repeated rows take it down ~0.7.
    assert losses[-1] < losses[0] - 0.2, losses

    # TRL's own labels are the whole sequence (assistant_only_loss=False); with autooffload, every
    # batch the model trained on had assistant-only labels: the answer and its end of turn, while
    # the system and user turns, the image's soft tokens, its begin/end markers and pads were -100.
    assert len(batches) >= SFT_STEPS
    expected = sorted(f"{colour.capitalize()}.<end_of_turn>" for colour in COLOURS)
    for batch in batches:
        ids, labels = batch["input_ids"], batch["labels"]
        assert int((ids == tokenizer.image_token_id).sum(dim=1).min()) == IMAGE_TOKENS
        media = (ids == tokenizer.image_token_id) | (ids == tokenizer.boi_token_id)
        media |= ids == tokenizer.eoi_token_id
        assert bool((labels[media] == IGNORE_INDEX).all())
        trained = [answers(tokenizer, row, row_labels) for row, row_labels in zip(ids, labels)]
        assert all(len(spans) == 1 for spans in trained), trained
        assert sorted(spans[0] for spans in trained) == expected, trained

    # The tower's offloaded weights were stepped (by the CPU optimizer), not just carried along.
    trained_tower = model.model.vision_tower.state_dict()
    assert any(not torch.equal(trained_tower[k], v) for k, v in initial_tower.items())

    inputs = probe_inputs(processor)
    plain, plain_logits = assert_last_checkpoint_reloads(
        model, tmp_path, SFT_STEPS, Gemma3ForConditionalGeneration, inputs
    )
    # ... and the image is part of what they compare: another image gives other logits.
    with torch.no_grad():
        blank = plain(**{**inputs, "pixel_values": torch.zeros_like(inputs["pixel_values"])})
    assert not torch.allclose(blank.logits, plain_logits)
