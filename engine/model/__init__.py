"""The model and its loading: ModelConfig (model_config.py), DeepseekModel (model.py), checkpoint
reading (loader.py) and load_model (build.py), which puts them together on one rank."""
