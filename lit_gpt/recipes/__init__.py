"""What the recipe scripts (generate/, finetune/, chat/, xla/) share: the steps around the loops that are the same
in every recipe of a kind. The layer above the loops (`lit_gpt.training`, `lit_gpt.generate`): nothing below
imports it (the import-linter contract in `.importlinter` holds that)."""
