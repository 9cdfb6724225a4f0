"""Epochs of exact mode: how records are ordered in each epoch and how what was consumed is kept."""
