"""DataLoader workers started with spawn or forkserver mask labels as the main process does."""

from __future__ import annotations

import functools

import pytest
import torch
from tokenizer_data import tokenizer_dir
from torch.utils.data import DataLoader

import autooffload
from autooffload.masking import IGNORE_INDEX
from tests.patches.test_hf_collators import CHAT, chat_features


@functools.cache
def tokenizer(name: str):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir(name))
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token  # Llama 3: pad = eos, as scripts set it
    return tok


def features(tok) -> list[dict[str, list[int]]]:
    return chat_features(tok, [CHAT, CHAT[:3], CHAT[1:3]])


def batches(collator, data, **loader_kwargs) -> list[dict[str, torch.Tensor]]:
    loader = DataLoader(data, batch_size=2, collate_fn=collator, **loader_kwargs)
    return [dict(batch) for batch in loader]


def assert_same_batches(got, expected) -> None:
    assert len(got) == len(expected)
    for batch, reference in zip(got, expected):
        assert batch.keys() == reference.keys()
        for key in reference:
            assert torch.equal(torch.as_tensor(batch[key]), torch.as_tensor(reference[key])), key


@pytest.mark.parametrize(
    ("context", "name"), [("spawn", "qwen3"), ("forkserver", "llama3.1"), ("fork", "qwen3")]
)
def test_transformers_collator_in_workers_masks_like_the_main_process(context, name):
    from transformers import DataCollatorForLanguageModeling

    autooffload.enable(device="cpu")
    tok = tokenizer(name)
    collator = DataCollatorForLanguageModeling(tok, mlm=False)
    data = features(tok)
    in_process = batches(collator, data)
    masked = in_process[0]["labels"]
    assert bool((masked == IGNORE_INDEX).any()) and not torch.equal(
        masked, in_process[0]["input_ids"]
    )
    in_workers = batches(collator, data, num_workers=2, multiprocessing_context=context)
    assert_same_batches(in_workers, in_process)


def test_sft_trainer_spawn_workers_mask_like_the_main_process(tmp_path):
    """TRL's text collator holds only a pad id; the tokenizer ``SFTTrainer`` gave it reaches the
    spawned workers with it, and their batches are those of ``dataloader_num_workers=0``."""
    datasets = pytest.importorskip("datasets")
    from tiny_qwen3 import tiny_qwen3
    from trl import SFTConfig, SFTTrainer

    autooffload.enable(device="cpu")
    tok = tokenizer("qwen3")
    rows = datasets.Dataset.from_list([{"messages": CHAT}, {"messages": CHAT[:3]}] * 2)
    config = SFTConfig(
        output_dir=str(tmp_path),
        per_device_eval_batch_size=2,
        dataloader_num_workers=2,
        dataloader_multiprocessing_context="spawn",
        report_to=[],
        use_cpu=True,
        bf16=False,
    )
    trainer = SFTTrainer(
        model=tiny_qwen3(len(tok)), args=config, train_dataset=rows, processing_class=tok
    )
    in_workers = [dict(batch) for batch in trainer.get_eval_dataloader(trainer.train_dataset)]
    trainer.args.dataloader_num_workers = 0
    trainer.args.dataloader_multiprocessing_context = None
    in_process = [dict(batch) for batch in trainer.get_eval_dataloader(trainer.train_dataset)]
    masked = in_process[0]["labels"]
    assert bool((masked == IGNORE_INDEX).any()) and not torch.equal(
        masked, in_process[0]["input_ids"]
    )
    assert_same_batches(in_workers, in_process)


def _seed_worker(worker_id: int) -> None:
    torch.manual_seed(worker_id)


def test_the_loader_keeps_its_worker_init_fn_and_disable_restores_it():
    from transformers import DataCollatorForLanguageModeling

    original = DataLoader._get_iterator
    autooffload.enable(device="cpu")
    assert DataLoader._get_iterator is not original
    tok = tokenizer("qwen3")
    collator = DataCollatorForLanguageModeling(tok, mlm=False)
    loader = DataLoader(
        features(tok),
        batch_size=2,
        collate_fn=collator,
        num_workers=1,
        multiprocessing_context="spawn",
        worker_init_fn=_seed_worker,
    )
    assert len(list(loader)) == 2
    assert loader.worker_init_fn is _seed_worker
    autooffload.disable()
    assert DataLoader.__dict__["_get_iterator"] is original
