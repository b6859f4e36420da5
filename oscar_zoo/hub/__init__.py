"""Publishing and fetching rotation artifacts: hub clients (Hugging Face, ModelScope) behind one small interface,
the zoo index (`zoo.json`) a multi-model repo keeps at its root, the generated model card, and the bundled catalog."""
