"""What a recipe costs: qt.analyze, qt.suggest_recipe and the PTQ flows (GPTQ, error diffusion)."""
