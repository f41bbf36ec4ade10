"""Train: `eaglenest train` fits the EAGLE-3 draft with training-time test on a feature store, or
(`--online`) on states an engine captures while training.

Public entry: `Trainer(TrainConfig(...)).fit()`.  Pieces: config.py (options), setup.py
(vocabulary, model, teacher, optimizer), data.py + loader.py (order, prefetched reads), online.py
(the engine as the data source), checkpoint.py (run directory, resume), distributed.py
(torchrun), metrics.py (acceptance and predicted tau), ttt.py (the TTT loop and the teacher), losses.py
(the training losses, one chunk at a time), memtrace.py (peak tensor bytes, for tests/test_losses.py's count at Kimi's vocabulary)."""

from eaglenest.train.config import TrainConfig
from eaglenest.train.trainer import Trainer

__all__ = ["TrainConfig", "Trainer"]
