"""kdp.tabular: declared schema -> bounded features, the exact norm bound, labels."""

import itertools
import json
import math
import subprocess
import sys

import numpy as np
import pytest

from kdp.tabular import Categorical, Numeric, TabularSchema


def schema():
    return TabularSchema(
        {"age": Numeric(18, 90),
         "income": Numeric(0, 1e6, transform="log1p"),
         "colour": Categorical(["red", "green", "blue"]),
         "grade": Categorical([1, 2, 3]),
         "smoker": Categorical([False, True])},
        label=("outcome", ["no", "yes"]), centre=False)


def table():
    return {
        "age": np.array([18, 54, 90, 10, 200]),
        "income": np.array([0.0, 1e3, 1e6, -5.0, 1e9]),
        "colour": np.array(["red", "green", "blue", "purple", "red"], dtype=object),
        "grade": np.array([1, 2, 3, 3, 7]),
        "smoker": np.array([True, False, True, False, True]),
        "outcome": np.array(["yes", "no", "yes", "no", "no"]),
    }


EXPECTED = np.array([
    # age, income, colour=red/green/blue, grade=1/2/3, smoker=False/True
    [0.0, 0.0, 1, 0, 0, 1, 0, 0, 0, 1],
    [0.5, math.log1p(1e3) / math.log1p(1e6), 0, 1, 0, 0, 1, 0, 1, 0],
    [1.0, 1.0, 0, 0, 1, 0, 0, 1, 0, 1],
    [0.0, 0.0, 0, 0, 0, 0, 0, 1, 1, 0],   # below both ranges, unseen colour
    [1.0, 1.0, 1, 0, 0, 0, 0, 0, 0, 1],   # above both ranges, unseen grade
], dtype="float32")


def test_features_names_and_bound_from_a_mapping_of_arrays():
    s = schema()
    x = s.transform(table())
    assert x.dtype == np.float32 and x.shape == (5, 10) == (5, *s.input_shape)
    np.testing.assert_allclose(x, EXPECTED, atol=1e-7)
    assert s.feature_names == ["age", "income", "colour=red", "colour=green", "colour=blue",
                               "grade=1", "grade=2", "grade=3", "smoker=False", "smoker=True"]
    assert s.max_norm == math.sqrt(5)
    np.testing.assert_array_equal(s.labels(table()), [1, 0, 1, 0, 0])
    assert s.labels(table()).dtype == np.int32 and s.nb_classes == 2


def test_a_pandas_dataframe_with_mixed_dtypes_gives_the_same_features():
    pd = pytest.importorskip("pandas")
    frame = pd.DataFrame(table())
    frame["colour"] = frame["colour"].astype("category")
    frame["grade"] = frame["grade"].astype("float64")    # 1.0 matches the level 1
    frame["age"] = frame["age"].astype("Int64")           # a nullable integer dtype
    assert len(set(map(str, frame.dtypes))) >= 5
    np.testing.assert_allclose(schema().transform(frame), EXPECTED, atol=1e-7)
    np.testing.assert_array_equal(schema().labels(frame), [1, 0, 1, 0, 0])
    # a non-default index: rows are still named by position
    frame.index = [10, 11, 12, 13, 14]
    frame.loc[12, "age"] = pd.NA
    with pytest.raises(ValueError, match=r"'age'.*row 2 \(0-based"):
        schema().transform(frame)


def test_missing_values_are_refused_with_their_row_unless_a_fill_is_declared():
    data = table()
    data["income"] = np.array([1.0, 2.0, np.nan, 4.0, 5.0])
    with pytest.raises(ValueError, match=r"column 'income': missing value .* row 2 .*missing="):
        schema().transform(data)
    filled = TabularSchema({"income": Numeric(0, 1e6, "log1p", missing=0.0)}, centre=False)
    x = filled.transform({"income": [1.0, None, np.nan, 1e6]})
    np.testing.assert_allclose(x[:, 0], [math.log1p(1) / math.log1p(1e6), 0, 0, 1], rtol=1e-6)


def test_out_of_range_values_infinities_included_are_clipped():
    s = TabularSchema({"v": Numeric(-2, 2), "w": Numeric(0, 4, transform="sqrt")}, centre=False)
    x = s.transform({"v": [-np.inf, -3, -2, 0, 1, 2, 5, np.inf], "w": [-1, 0, 1, 4, 9, 1, 1, 1]})
    np.testing.assert_allclose(x[:, 0], [0, 0, 0, 0.5, 0.75, 1, 1, 1])
    np.testing.assert_allclose(x[:, 1], [0, 0, 0.5, 1, 1, 0.5, 0.5, 0.5])


def test_unknown_levels_give_a_zero_block_or_an_error():
    zero = TabularSchema({"c": Categorical(["a", "b"])}, centre=False)
    np.testing.assert_array_equal(zero.transform({"c": ["b", "z", None, np.nan, 1]}),
                                  [[0, 1], [0, 0], [0, 0], [0, 0], [0, 0]])
    strict = TabularSchema({"c": Categorical(["a", "b"], unknown="error")})
    with pytest.raises(ValueError, match=r"column 'c': .* not a declared level in row 1"):
        strict.transform({"c": ["a", "z"]})
    np.testing.assert_array_equal(  # "1" is not the level 1
        TabularSchema({"c": Categorical([1])}, centre=False).transform({"c": ["1", 1]}), [[0], [1]])


def test_labels_map_declared_levels_and_refuse_others():
    s = TabularSchema({"x": Numeric(0, 1)}, label=("y", [3, 1, 2]), centre=False)
    np.testing.assert_array_equal(s.labels({"y": np.array([1, 2, 3, 3])}), [1, 2, 0, 0])
    assert s.nb_classes == 3
    with pytest.raises(ValueError, match=r"label column 'y': .* row 2"):
        s.labels({"y": [1, 2, 4]})
    with pytest.raises(ValueError, match="row 0"):
        s.labels({"y": [np.nan]})
    # transform does not need the label column, and ignores it when present
    np.testing.assert_array_equal(s.transform({"x": [0.5], "y": [1]}), [[0.5]])
    no_label = TabularSchema({"x": Numeric(0, 1)})
    assert no_label.nb_classes is None
    with pytest.raises(ValueError, match="declares no label"):
        no_label.labels({"x": [0.5]})


def test_missing_and_undeclared_columns_are_refused_unless_ignored():
    s = TabularSchema({"x": Numeric(0, 1), "c": Categorical(["a"])})
    with pytest.raises(ValueError, match=r"lacks the declared columns \['c'\]"):
        s.transform({"x": [0.5]})
    with pytest.raises(ValueError, match=r"undeclared columns \['id'\].*ignore="):
        s.transform({"x": [0.5], "c": ["a"], "id": [7]})
    ignoring = TabularSchema({"x": Numeric(0, 1), "c": Categorical(["a"])}, ignore=["id"],
                             centre=False)
    np.testing.assert_array_equal(ignoring.transform({"x": [0.5], "c": ["a"], "id": [7]}), [[0.5, 1]])
    with pytest.raises(ValueError, match="different lengths"):
        s.transform({"x": [0.5, 0.1], "c": ["a"]})
    with pytest.raises(ValueError, match="not 1-D"):
        s.transform({"x": [[0.5]], "c": ["a"]})
    with pytest.raises(ValueError, match="not numbers"):
        s.transform({"x": ["high"], "c": ["a"]})
    with pytest.raises(TypeError, match="DataFrame or a mapping"):
        s.transform(np.zeros((1, 2)))


@pytest.mark.parametrize("make, match", [
    (lambda: Numeric(1, 1), "low < high"),
    (lambda: Numeric(0, np.inf), "finite"),
    (lambda: Numeric(-1, 1, transform="log1p"), "log1p' needs low > -1"),
    (lambda: Numeric(-1, 1, transform="sqrt"), "increasing"),
    (lambda: Numeric(0, 1, transform="log"), "transform must be"),
    (lambda: Numeric(0, 1, transform=lambda v: -v), "increasing"),
    (lambda: Numeric(0, 1, missing=2), "missing=2 must lie"),
    (lambda: Categorical([]), "at least one level"),
    (lambda: Categorical("abc"), "must be a list"),
    (lambda: Categorical([1, 1.0]), "distinct"),
    (lambda: Categorical([1, True]), "distinct"),
    (lambda: Categorical([float("nan")]), "finite floats"),
    (lambda: Categorical(["a"], unknown="ignore"), "'zero' or 'error'"),
    (lambda: TabularSchema({}), "at least one column"),
    (lambda: TabularSchema({"x": (0, 1)}), "Numeric"),
    (lambda: TabularSchema({"x": Numeric(0, 1)}, label=("x", [0, 1])), "also a feature"),
    (lambda: TabularSchema({"x": Numeric(0, 1)}, label=["a"]), r"\(name, levels\)"),
    (lambda: TabularSchema({"x": Numeric(0, 1)}, ignore=["x"]), "ignore lists declared"),
])
def test_invalid_declarations_are_refused(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_a_monotone_callable_transform():
    s = TabularSchema({"v": Numeric(1, 8, transform=np.cbrt)}, centre=False)
    np.testing.assert_allclose(s.transform({"v": [0, 1, 8, 27]})[:, 0], [0, 0, 1, 1])
    with pytest.raises(ValueError, match="callable transform cannot be saved"):
        s.get_config()


def test_a_callable_transform_is_applied_per_value():
    """A callable sees one value at a time, so a row's feature cannot depend on
    another row: with a transform that adds a thousandth of whatever it is given's
    mean, changing row 1 leaves row 0 unchanged, and each feature is the callable
    of its own value. A standardiser by the column's mean and std is refused
    (one value has no spread), naming the fix; a callable that fails on one
    value names the column."""
    def leaky(v):
        return np.log1p(v) + 1e-3 * np.mean(v)

    s = TabularSchema({"a": Numeric(0, 100, transform=leaky)}, centre=False)
    x = s.transform({"a": [10.0, 20.0, 30.0]})[:, 0]
    y = s.transform({"a": [10.0, 90.0, 30.0]})[:, 0]
    assert x[0] == y[0] and x[2] == y[2] and x[1] != y[1]
    ends = [leaky(0.0), leaky(100.0)]
    np.testing.assert_allclose(x, [(leaky(v) - ends[0]) / (ends[1] - ends[0]) for v in (10, 20, 30)],
                               rtol=1e-6)
    with pytest.raises(ValueError, match="one value at a time.*declared constants"):
        Numeric(0, 10, transform=lambda v: (v - np.mean(v)) / np.std(v))
    partial = TabularSchema({"b": Numeric(0, 10, transform=lambda v: {0.0: 0.0, 10.0: 1.0}[v])})
    with pytest.raises(ValueError, match="column 'b': the transform failed on the value 5.0"):
        partial.transform({"b": [0.0, 5.0]})


def test_the_config_round_trips_through_json():
    s = TabularSchema({0: Numeric(0, 10, "sqrt", missing=1), "c": Categorical([2, "2", None], "error")},
                      label=("y", [0, 1]), ignore=["id"])
    config = json.loads(json.dumps(s.get_config()))
    assert config == s.get_config()
    t = TabularSchema.from_config(config)
    assert list(t.columns) == [0, "c"] and t.label == ("y", [0, 1]) and t.ignore == ["id"]
    assert (t.feature_names, t.max_norm, t.nb_classes) == (s.feature_names, s.max_norm, s.nb_classes)
    data = {0: [4.0, np.nan], "c": ["2", None], "y": [1, 0], "id": [5, 6]}
    np.testing.assert_array_equal(t.transform(data), s.transform(data))
    np.testing.assert_array_equal(t.labels(data), [1, 0])


# --- the norm bound: exact on adversarial rows, and the check catches a wrong one --------------

def adversarial_rows(s):
    """Every combination of extreme values: each numeric at -inf, below, at and above
    its range ends, mid-range and missing; each categorical on every level and an unknown one."""
    choices = []
    for spec in s.columns.values():
        if isinstance(spec, Numeric):
            mid = (spec.low + spec.high) / 2
            choices.append([-np.inf, spec.low - 1, spec.low, mid, spec.high, spec.high + 1,
                            np.inf, np.nan])
        else:
            choices.append([*spec.levels, "<unknown>"])
    rows = list(itertools.product(*choices))
    return {name: np.array([row[i] for row in rows], dtype=object)
            for i, name in enumerate(s.columns)}


def bound_violations(x, bound):
    """``(rows above bound, bound attained)``: the bound must give ``(0, True)``."""
    norms = np.linalg.norm(x.astype("float64"), axis=1)
    return int(np.sum(norms > bound * (1 + 1e-6))), bool(np.isclose(norms.max(), bound, rtol=1e-6))


def bounded_schema(centre=False):
    return TabularSchema({
        "a": Numeric(-5, 5, missing=0), "b": Numeric(0, 100, "log1p", missing=3),
        "c": Numeric(1, 4, "sqrt", missing=4), "d": Categorical(["x", "y", "z"]),
        "e": Categorical([0, 1]), "f": Categorical(["only"])}, centre=centre)


def test_the_bound_is_exact_over_adversarial_rows():
    s = bounded_schema()
    x = s.transform(adversarial_rows(s))
    assert len(x) == 8 ** 3 * 4 * 3 * 2
    assert bound_violations(x, s.max_norm) == (0, True)
    assert s.max_norm == math.sqrt(6)


def test_the_check_catches_a_bound_that_omits_the_categoricals():
    s = bounded_schema()
    x = s.transform(adversarial_rows(s))
    numeric_only = math.sqrt(sum(isinstance(c, Numeric) for c in s.columns.values()))
    violations, _ = bound_violations(x, numeric_only)
    assert violations > 0
    assert bound_violations(x, s.max_norm * 1.01)[1] is False  # a loose bound is not exact


def centred(s):
    """``s`` with the default, ``centre=True``."""
    return TabularSchema(s.columns, label=s.label, ignore=s.ignore)


def test_centring_moves_each_column_by_the_centre_of_its_box():
    s = schema()  # uncentred
    x = centred(s).transform(table())
    offsets = np.array([0.5, 0.5, 1 / 3, 1 / 3, 1 / 3, 1 / 3, 1 / 3, 1 / 3, 0.5, 0.5])
    np.testing.assert_allclose(x, EXPECTED - offsets, atol=1e-7)
    assert centred(s).feature_names == s.feature_names
    # 2 numeric (1/4 each), colour and grade (k = 3: 2/3), smoker (k = 2: 1/2)
    assert math.isclose(centred(s).max_norm, math.sqrt(0.5 + 2 * 2 / 3 + 0.5))


def test_the_centred_bound_is_exact_over_adversarial_rows():
    s = bounded_schema(centre=True)
    x = s.transform(adversarial_rows(s))
    assert bound_violations(x, s.max_norm) == (0, True)
    # a, b, c: 1/4; d (k = 3): 2/3; e (k = 2): 1/2; f (k = 1): 1 (an unknown value)
    assert math.isclose(s.max_norm, math.sqrt(3 / 4 + 2 / 3 + 1 / 2 + 1))
    assert s.max_norm < 0.85 * bounded_schema().max_norm


def test_the_check_catches_a_centred_bound_that_omits_unknown_levels():
    s = bounded_schema(centre=True)
    x = s.transform(adversarial_rows(s))
    declared_levels_only = math.sqrt(sum(
        0.25 if isinstance(c, Numeric) else 1 - 1 / len(c.levels) for c in s.columns.values()))
    assert bound_violations(x, declared_levels_only)[0] > 0
    strict = TabularSchema({"f": Categorical(["only"], unknown="error"), "a": Numeric(0, 1)},
                           centre=True)  # no unknown value can reach the model: 1 - 1/k
    assert math.isclose(strict.max_norm, 0.5)


def test_centre_round_trips_through_the_config_and_defaults_to_off_in_old_configs():
    s = centred(schema())
    config = json.loads(json.dumps(s.get_config()))
    assert config["centre"] is True
    np.testing.assert_array_equal(TabularSchema.from_config(config).transform(table()),
                                  s.transform(table()))
    del config["centre"]  # a config saved before the option: the features it gave
    np.testing.assert_allclose(TabularSchema.from_config(config).transform(table()), EXPECTED,
                               atol=1e-7)


def test_importing_kdp_tabular_imports_neither_keras_nor_pandas():
    code = ("import sys, kdp.tabular; "
            "print(sorted(m for m in ('keras', 'pandas', 'tensorflow', 'jax') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
