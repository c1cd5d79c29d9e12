"""Build system of transformers-mst: upstream wheel + patch series + our files -> wheel."""
