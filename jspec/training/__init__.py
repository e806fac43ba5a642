"""The offline makers, one verb each: distillation data (distill, teacher_forced), heads
(train_head over head_data), SpecEE's predictors (train_predictors), the datastore
(build_datastore), KNN-SSD's skip sets and anchors (search_skip, fit_knn)."""
