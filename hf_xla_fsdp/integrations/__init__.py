"""Glue to the Hugging Face tools: accelerate (``XlaFsdpAccelerator``), transformers' Trainer
(``XlaFsdpTrainer``) and the Hub (export with a model card). Each module is imported on first use."""
