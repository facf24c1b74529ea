"""Prediction: features (online and offline), the predictors, the model registry and the tool
run times."""
