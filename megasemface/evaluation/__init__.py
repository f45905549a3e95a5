"""Translation quality: corpus BLEU and chrF (sacreBLEU), logged to MLflow."""
