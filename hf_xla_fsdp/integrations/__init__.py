"""Thin adapters to the Hugging Face tools: accelerate (``XlaFsdpAccelerator``), transformers' Trainer
(``XlaFsdpTrainer``), TRL (``XlaFsdpSFTTrainer``); ``upstream`` lists the private upstream APIs they rely on.
Each module is imported on first use."""
