"""Training the arrival model from the service's event logs. For notebooks:

    from training import build_dataset, train, save_model, evaluate

    df = build_dataset(["var/events"])                # rows: features, horizon, label
    model = train(df, {"num_leaves": 63})             # time-based split inside
    save_model(model, Path("models/mine"))            # model.txt + card.json
    evaluate("models/mine", "trace.jsonl", "default") # replay: learned vs none, heuristic, oracle
"""

from training.dataset import build_dataset
from training.evaluate import evaluate
from training.train import TrainedModel, save_model, train

__all__ = ["TrainedModel", "build_dataset", "evaluate", "save_model", "train"]
