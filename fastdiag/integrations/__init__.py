"""Ready-made hooks into training frameworks: `fastdiag.integrations.lightning.FastdiagCallback`
(Lightning) and `fastdiag.integrations.hf.FastdiagCallback` (Hugging Face Trainer). Each module
imports its framework, so import the one you use."""
