"""From rank files to what users load and share: PEFT adapter files and merged models (``peft``) and
``from_pretrained``-ready exports with a model card, pushed to the Hub if asked (``hub``)."""
