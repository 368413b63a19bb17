"""The demo MTP layer's training losses (colibri_stream/devtools/train_demo_mtp.py mtp_loss): the data's
next-next token, or the main model's own next distribution, each at the position the MTP predicts."""

from __future__ import annotations

import torch

from colibri_stream.devtools.train_demo_mtp import mtp_loss


def _logits(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 3


def test_the_distilled_target_is_the_main_models_distribution_one_position_on():
    main = _logits(2, 6, 11, seed=0)  # main[:, j] predicts token j + 1
    window = torch.randint(0, 11, (2, 8), generator=torch.Generator().manual_seed(1))
    aligned = torch.cat([main[:, 1:], _logits(2, 1, 11, seed=2)], dim=1)  # the MTP at i says what main at i + 1 does
    best = mtp_loss(aligned, main, window, distill=True)
    target = torch.softmax(main[:, 1:], dim=-1)
    entropy = -(target * torch.log_softmax(main[:, 1:], dim=-1)).sum(-1).mean()
    torch.testing.assert_close(best, entropy)  # cross-entropy at its minimum: the target's own entropy
    assert mtp_loss(main, main, window, distill=True) > best + 0.1  # one position off: worse
    assert mtp_loss(aligned * 0.5, main, window, distill=True) > best  # a flatter guess: worse


def test_the_plain_loss_scores_the_data_two_tokens_on():
    window = torch.randint(0, 11, (2, 8), generator=torch.Generator().manual_seed(3))
    certain = torch.full((2, 6, 11), -30.0).scatter(-1, window[:, 2:, None], 30.0)
    assert mtp_loss(certain, certain, window, distill=False) < 1e-6
    shifted = torch.full((2, 6, 11), -30.0).scatter(-1, window[:, 1:-1, None], 30.0)
    assert mtp_loss(shifted, certain, window, distill=False) > 1.0  # one position off
