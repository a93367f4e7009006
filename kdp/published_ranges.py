"""Published per-column ranges of scikit-learn's bundled tables.

Each range is the column's Min / Max in the "Summary Statistics" of the
dataset's documentation (scikit-learn's ``DESCR``, copied from the UCI
documentation), in the column order of ``load_*().data``. They are public
facts about the data sets, not statistics computed by kdp, so mapping a row
with them costs no privacy. The published numbers are rounded: a few values
fall just outside and are clipped by the mapping.

This module imports nothing, so that the benchmarks' baseline environments
(which do not install kdp) can read the same constants from its file.
"""

# Wisconsin diagnostic breast cancer (wdbc.names): the ten measurements' mean,
# then their standard error, then their "worst" value.
_BREAST_CANCER_MEAN = (
    (6.981, 28.11), (9.71, 39.28), (43.79, 188.5), (143.5, 2501.0), (0.053, 0.163),
    (0.019, 0.345), (0.0, 0.427), (0.0, 0.201), (0.106, 0.304), (0.05, 0.097))
_BREAST_CANCER_SE = (
    (0.112, 2.873), (0.36, 4.885), (0.757, 21.98), (6.802, 542.2), (0.002, 0.031),
    (0.002, 0.135), (0.0, 0.396), (0.0, 0.053), (0.008, 0.079), (0.001, 0.03))
_BREAST_CANCER_WORST = (
    (7.93, 36.04), (12.02, 49.54), (50.41, 251.2), (185.2, 4254.0), (0.071, 0.223),
    (0.027, 1.058), (0.0, 1.252), (0.0, 0.291), (0.156, 0.664), (0.055, 0.208))
BREAST_CANCER = _BREAST_CANCER_MEAN + _BREAST_CANCER_SE + _BREAST_CANCER_WORST

# Wine recognition (wine.names): alcohol, malic acid, ash, alcalinity of ash,
# magnesium, total phenols, flavanoids, nonflavanoid phenols, proanthocyanins,
# colour intensity, hue, OD280/OD315 of diluted wines, proline.
WINE = ((11.0, 14.8), (0.74, 5.80), (1.36, 3.23), (10.6, 30.0), (70.0, 162.0),
        (0.98, 3.88), (0.34, 5.08), (0.13, 0.66), (0.41, 3.58), (1.3, 13.0),
        (0.48, 1.71), (1.27, 4.00), (278.0, 1680.0))

# Iris (Fisher 1936; iris.names): sepal length, sepal width, petal length,
# petal width, in cm.
IRIS = ((4.3, 7.9), (2.0, 4.4), (1.0, 6.9), (0.1, 2.5))

#: the ranges by scikit-learn dataset name (``sklearn.datasets.load_<name>``)
RANGES = {"breast_cancer": BREAST_CANCER, "wine": WINE, "iris": IRIS}
