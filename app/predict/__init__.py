"""Prediction: features (online and offline), the predictors and the model registry."""
