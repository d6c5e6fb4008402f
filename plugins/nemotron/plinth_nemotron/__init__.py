"""plinth-nemotron: Nemotron-H hybrid architectures and their HF converter."""
