"""Training: the TTT loss (ttt.py), data order (data.py) and the loop (trainer.py)."""

from eaglenest.train.trainer import TrainConfig, Trainer

__all__ = ["TrainConfig", "Trainer"]
