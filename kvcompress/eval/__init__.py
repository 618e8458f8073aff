"""Evaluation: real q/k/v capture, real-prose text, offline task generators."""
